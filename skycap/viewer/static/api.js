// Fetch helpers for the viewer's JSON API (/api/v1); errors carry the server's message.

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export async function getJSON(path) {
  const response = await fetch(path, { headers: { Accept: "application/json" } });
  const body = await response.json().catch(() => ({ error: `HTTP ${response.status}` }));
  if (!response.ok) throw new ApiError(response.status, body.error || `HTTP ${response.status}`);
  return body;
}

export function runPath(run) {
  return `/api/v1/runs/${encodeURIComponent(run)}`;
}

export function trajectoryPath(run, id) {
  return `${runPath(run)}/trajectories/${encodeURIComponent(id)}`;
}

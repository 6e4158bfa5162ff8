"""The `mitmdump -s` script that runs skycap as a mitmproxy addon, configured with `--set`.

    mitmdump -q -s addons/skycap.py --mode reverse:http://engine:8000 \
        --listen-host 127.0.0.1 --listen-port 8080 \
        --set connection_strategy=lazy --set keep_host_header=true \
        --set skycap_upstream_url=http://engine:8000/v1 --set skycap_record_dir=/data/rec

`connection_strategy=lazy` is required (skycap answers control routes and refusals
itself; with `eager` a down upstream closes the client before any hook runs).
`keep_host_header=true` lets `POST /trajectories` build `base_url` from the Host header
the trainer used; without it the listening address is used. `skycap_upstream_url`
decides where harness calls go; the `--mode reverse:` target only carries the
listener. Every `skycap serve` flag has a `skycap_<flag>` option (`--set
skycap_mode=tokens`, `--set skycap_ttl=600`, `--set skycap_path_rule=best=pkg.mod:fn`,
...) except `--host`/`--port`, which are mitmproxy's `--listen-host`/`--listen-port`;
see skycap/server/options.py for the table. Do not set `body_size_limit` (it answers
before skycap can); use `skycap_max_body_size`. `skycap serve` runs the same
addon with a leaner mitmproxy and is faster.

HTTPS_PROXY capture (docs/proxy.md) adds a forward-proxy listener with mitmproxy's own
`--mode regular@8081` beside the reverse mode (and `--set confdir=DIR` for skycap's CA);
in text mode `skycap_upstream_url` is then optional: calls through the proxy go to their
original host.
"""

import atexit
import os
import sys

# mitmproxy puts this script's folder first on sys.path, where this file, named skycap.py,
# would shadow the skycap package: import the package from the environment instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from skycap.logqueue import install_log_queue, uninstall_log_queue  # noqa: E402
from skycap.server.addon import SkycapAddon  # noqa: E402

# Log lines leave through a queue and a writer thread, so a slow reader of mitmdump's output
# never stalls the loop (docs/serving.md "Logs"); what is queued is written at exit.
install_log_queue()
atexit.register(uninstall_log_queue)
addons = [SkycapAddon()]

"""The exit statuses of the serving tools, in one place: `run` (the supervisor), `memguard watch`
and `watchdog watch` return them, and each reads the others' from here (the watchdog and the
supervisor import no module of the other's for them)."""

from __future__ import annotations

__all__ = ["ENGINE_DIED", "GUARD_STOPPED", "REFUSED", "WATCHDOG_DIED", "WATCHDOG_STOPPED"]

REFUSED = 2  # `run`'s status when it refused to start (bad options, a pid file that is not ours)
GUARD_STOPPED = 3  # the memory guard's status when it stopped the server (`memguard watch` exits with it)
WATCHDOG_STOPPED = 4  # the watchdog's status when it stopped the server (`watchdog watch` exits with it)
ENGINE_DIED = 5  # `run`'s status when the engine died (the API server's own status is 0)
WATCHDOG_DIED = 7  # `run`'s status when the watchdog or the guard died while the server ran (it is stopped)

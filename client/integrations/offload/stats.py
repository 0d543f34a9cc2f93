"""The counters the scheduler side keeps (its thread only), for the benchmark, the logs and tests."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ManagerStats:
    batches: int = 0                  # batched lookups sent
    late: int = 0                     # lookup waits that ran out (answered next step)
    waited_s: float = 0.0             # time the scheduler thread spent waiting for kvtierd
    retries: int = 0                  # RETRY answers
    down: int = 0                     # lookups answered MISS without asking (kvtierd away or slow)
    stores_skipped: int = 0           # prepare_store answered "not stored" without asking
    load_failures: int = 0            # requests whose load failed (reported by the engine)
    renewals: int = 0                 # batches sent to renew a waiting request's leases
    leased_loads: int = 0             # load jobs that named a lease

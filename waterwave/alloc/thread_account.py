"""``ThreadAccount``: the bytes one thread allocates through one of Waterwave's
ledgers (csrc/runtime/thread_accounts.h) while it is tagged with the
account: the CUDA runtime's (``_C.cuda_accounts()``, the default) or the
CPU's (``_C.cpu_accounts()``, once the CPU allocator is installed:
``cpu_allocator.py``). The allocator's own counters cover the whole device,
and only the allocating thread knows whose memory it is. A training session
tags a job's thread between the job's ``train()`` calls (``between_calls``),
and ``waterwave.sharing`` tags each member's thread inside its block.

May import: waterwave._C.
"""
from __future__ import annotations

import weakref

from .. import _C


class ThreadAccount:
    """An open account; closed when dropped (or by ``close``)."""

    def __init__(self, ledger: _C.ThreadAccounts | None = None):
        self.ledger = ledger if ledger is not None else _C.cuda_accounts()
        self.id = self.ledger.open()
        self._close = weakref.finalize(self, self.ledger.close, self.id)

    def tag(self) -> int:
        """Tag the calling thread; returns the tag it had (0: none)."""
        return _C.ThreadAccounts.set_thread(self.id)

    @staticmethod
    def untag(previous: int = 0) -> int:
        """Give the calling thread ``previous`` back (0: no tag); returns
        the tag it had."""
        return _C.ThreadAccounts.set_thread(previous)

    def usage(self) -> tuple[int, int]:
        """(bytes allocated under the account and still live, the most that
        were at once since ``reset_peak``)."""
        return self.ledger.usage(self.id)

    def reset_peak(self) -> None:
        self.ledger.reset_peak(self.id)

    def close(self) -> None:
        self._close()

    def __repr__(self) -> str:
        return f"ThreadAccount({self.id})"

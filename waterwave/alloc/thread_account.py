"""``ThreadAccount``: the bytes one thread allocates through Waterwave's CUDA
entry points while it is tagged with the account (csrc/runtime/
thread_accounts.h). A training session tags a job's thread between the
job's ``train()`` calls, so that what the job allocates there (evaluation,
metrics) is measured while other threads train beside it: the allocator's
own counters cover the whole device, and only the allocating thread knows
whose memory it is.

May import: waterwave._C.
"""
from __future__ import annotations

import weakref

from .. import _C


class ThreadAccount:
    """An open account; closed when dropped (or by ``close``)."""

    def __init__(self):
        self.id = _C.cuda_open_account()
        self._close = weakref.finalize(self, _C.cuda_close_account, self.id)

    def tag(self) -> int:
        """Tag the calling thread; returns the tag it had (0: none)."""
        return _C.cuda_set_thread_account(self.id)

    @staticmethod
    def untag(previous: int = 0) -> int:
        """Give the calling thread ``previous`` back (0: no tag); returns
        the tag it had."""
        return _C.cuda_set_thread_account(previous)

    def usage(self) -> tuple[int, int]:
        """(bytes allocated under the account and still live, the most that
        were at once since ``reset_peak``)."""
        return _C.cuda_account_usage(self.id)

    def reset_peak(self) -> None:
        _C.cuda_reset_account_peak(self.id)

    def close(self) -> None:
        self._close()

    def __repr__(self) -> str:
        return f"ThreadAccount({self.id})"

"""A hub download's progress: huggingface_hub's bar on a terminal, else a `[prepare]`
line and a `model_download` log event at each tenth."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from .downloads import say

if TYPE_CHECKING:
    from tqdm import tqdm as base_tqdm

log = structlog.get_logger(__name__)


@dataclass
class Transfer:
    """One download as its progress bar sees it: huggingface_hub makes the bar only when it
    downloads, so a fetch from the cache says nothing. Without a bar (`lines`), each step
    is also a `model_download` log event whose fields a log shipper reads: `phase` (start,
    resume, progress, done), `file`, `done_bytes`, `total_bytes`, `percent`, `seconds`."""

    label: str
    endpoint: str
    lines: bool = False
    size: float | None = None
    started: float | None = None
    tenths: int = 0  # the last tenth said

    def begin(self, size: float | None, initial: float = 0) -> None:
        """`initial`: the bytes an earlier start left, which this download resumes from."""
        # A retried download keeps its bar, but a Xet one makes two.
        if self.started is not None:
            return
        self.started, self.size = time.monotonic(), size
        self._event("resume" if initial and size else "start", initial, endpoint=self.endpoint)
        if initial and size:
            self.tenths = int(10 * initial / size)
            say(
                f"resuming {self.label} at {amount(initial)} of {amount(size)} from {self.endpoint}"
            )
            return
        of = f" ({amount(size)})" if size else ""
        say(f"downloading {self.label}{of} from {self.endpoint}")

    def report(self, done: float, size: float | None) -> None:
        tenths = int(10 * done / size) if size else 0
        if self.tenths < tenths < 10 and size:
            self.tenths = tenths
            self._event("progress", done)
            say(f"downloading {self.label}: {10 * tenths}% ({amount(done)} of {amount(size)})")

    def finish(self) -> None:
        if self.started is None:
            return
        took = time.monotonic() - self.started
        self._event("done", self.size, seconds=round(took, 3))
        of = f": {amount(self.size)}" if self.size else ""
        say(f"downloaded {self.label}{of} in {took:.1f} s")

    def _event(self, phase: str, done: float | None, **fields: Any) -> None:
        if not self.lines:
            return  # a log line would break into the bar's redraws
        total = int(self.size) if self.size else None
        log.info(
            "model_download",
            phase=phase,
            file=self.label,
            done_bytes=int(done or 0),
            total_bytes=total,
            percent=round(100 * (done or 0) / total, 1) if total else None,
            **fields,
        )


def amount(size: float) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"


def lines_class(transfer: Transfer) -> type[base_tqdm[Any]]:
    from huggingface_hub.utils.tqdm import tqdm

    class Lines(tqdm):
        """No bar: a `say` line at each tenth, for logs that a bar's redraws would garble."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            transfer.begin(kwargs.get("total"), kwargs.get("initial") or 0)
            kwargs["disable"] = True  # tqdm draws nothing; `update` counts
            super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]

        def update(self, n: float | None = 1) -> bool | None:
            self.n += n or 0
            transfer.report(self.n, self.total)
            return None

        def update_transfer(self, n: float) -> None:
            """Bytes off the network, which a Xet download counts apart from bytes written:
            with this method it reports both to one bar, and only the written are said."""

        def set_transfer_postfix_str(self, s: str = "", refresh: bool = True) -> None:
            """The network rate of a Xet download, which the lines leave out."""

    return Lines


def bar_class(transfer: Transfer) -> type[base_tqdm[Any]]:
    from huggingface_hub.utils.tqdm import tqdm

    class Bar(tqdm):
        """huggingface_hub's bar, which also tells `transfer` that a download began."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            transfer.begin(kwargs.get("total"), kwargs.get("initial") or 0)
            # A plain HTTP download is labelled with its URL, cut to its last 40 characters.
            if kwargs.get("name") == "huggingface_hub.http_get":
                kwargs["desc"] = transfer.label
            if kwargs.get("disable") is None:
                kwargs["disable"] = False  # a bar was asked for, terminal or not
            super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]

    return Bar

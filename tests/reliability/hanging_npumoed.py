"""`npumoed` whose model hangs for good in its first MoE layer, the first time that layer runs.

    python hanging_npumoed.py MARKER npumoed-arguments…

The hang is a wait that never ends, in a forward pre-hook the engine knows nothing of: what a deadlocked
kernel or a driver call that never returns looks like from Python. MARKER is created as it starts, so the
next process (the service manager's restart) runs normally.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

from npumoe.engine import Engine
from npumoe.engine.moe.model_experts import moe_experts


def hang_once(marker: Path) -> None:
    real_load = Engine.load.__func__  # type: ignore[attr-defined]

    def load(cls: type[Engine], settings: Any) -> Engine:
        engine = real_load(cls, settings)

        def hang(*_: object) -> None:
            if not marker.exists():
                marker.touch()
                threading.Event().wait()

        moe_experts(engine.loaded.model)[0][1].register_forward_pre_hook(hang)
        return engine

    Engine.load = classmethod(load)  # type: ignore[method-assign,assignment]


if __name__ == "__main__":
    hang_once(Path(sys.argv[1]))
    sys.argv = ["npumoed", *sys.argv[2:]]
    from npumoe.daemon.cli import main

    main()

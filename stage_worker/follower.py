"""`python -m layerline.stage_worker.follower`: a rank > 0 of a tensor-parallel stage.

Rank 0 (`layerline stage --tp T`) starts this process once per other rank (`tp_group`) and writes
the stage's `StageSettings`, as JSON, to its standard input; the rank and rank 0's rendezvous
address come as arguments. Owns only reading them and starting the follower loop.
"""

from __future__ import annotations

import argparse
import sys

from layerline.shared.settings import configure_logging, from_json

from .settings import StageSettings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m layerline.stage_worker.follower",
        description="A rank > 0 of a tensor-parallel stage (started by rank 0); settings as JSON on stdin.",
    )
    parser.add_argument("--rank", type=int, required=True, help="this process's rank, 1 or more")
    parser.add_argument("--master", required=True, metavar="HOST:PORT", help="rank 0's rendezvous address")
    args = parser.parse_args(argv)
    settings = from_json(StageSettings, sys.stdin.read())
    configure_logging()
    from .server import run_follower  # torch: only once the arguments are good

    return run_follower(settings, rank=args.rank, master=args.master)


if __name__ == "__main__":
    sys.exit(main())

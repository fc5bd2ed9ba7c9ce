"""The chaos soak, as `layerline bench chaos` runs it, on a tiny random model with SmolLM2's
tokenizer: `up --replicas 2 --stages 2` under 24 streams of greedy and seeded requests while a
driver SIGKILLs a random stage worker 3 times and SIGSTOPs one for 6 s, in 30 s. Every request
must come back with exactly the tokens of the fault-free run, and `up` must serve 4 workers at
the end."""

from __future__ import annotations

import random
import shutil

import pytest

from layerline.bench.chaos import ChaosPlan, run_chaos

from .stage_client import free_port
from .tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.cluster


@pytest.mark.timeout(600)
def test_a_soak_of_kills_and_a_stop_under_up_loses_no_request_and_no_token(real_model_dir, tmp_path):
    model = tmp_path / "model"
    make_tiny_checkpoint("smollm2", model, vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real_model_dir / name, model / name)
    seed = random.randrange(2**32)
    print(f"chaos seed: {seed}")
    report = run_chaos(
        ChaosPlan(
            model=str(model),
            port=free_port(),
            run_dir=tmp_path / "run",
            duration=30,
            streams=24,
            new_tokens=24,
            kills=3,
            stop_seconds=6,
            seed=seed,
            log=print,
        )
    )
    print("\n".join(report.lines()))
    assert len(report.faults) == 4 and sum(f.startswith("SIGKILL") for f in report.faults) == 3
    assert report.requests > 24
    assert report.errors == [] and report.failed == 0
    assert report.tokens_lost == 0 and report.completed == report.requests
    assert report.serving_at_end == 4 and report.chains_at_end == 2
    assert report.failovers > 0 and report.passed()

"""`layerline bench speculate`: speculative decoding by prompt lookup against plain decoding.

Runs one cluster whose coordinator speculates (`--speculate K`) and sends every prompt twice
in each round, once with `speculate=0` and once with the coordinator's K, alternating which goes
first, one request at a time: the figure is a lone stream's latency. Two workloads: answers
that quote and edit their prompt (code with a name changed, a paragraph copied), and ordinary
prompts, whose drafts mostly miss. For each it reports the decode rate of both (tokens after the
first over the time after the first token, summed over requests), their ratio, and the share of
drafted tokens accepted (from the coordinator's counters). Greedy answers must be token for token
the same with and without speculation, or the bench raises.

Knows nothing of the coordinator's internals: it sees the SDK and ClusterStatus.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from layerline.client import Client
from layerline.launcher import ClusterPlan, LocalCluster
from layerline.shared.cpu import cpu_name

_CODE = (
    "def total_price(items, tax_rate):\n"
    "    subtotal = 0\n"
    "    for item in items:\n"
    "        subtotal += item.price * item.quantity\n"
    "    tax = subtotal * tax_rate\n"
    "    return subtotal + tax\n"
)
_CLASS = (
    "class Counter:\n"
    "    def __init__(self):\n"
    "        self.counts = {}\n"
    "\n"
    "    def add(self, word):\n"
    "        self.counts[word] = self.counts.get(word, 0) + 1\n"
    "\n"
    "    def most_common(self):\n"
    "        return max(self.counts, key=self.counts.get)\n"
)
_JS = (
    "function fetchUser(id) {\n"
    "  const url = `/api/users/${id}`;\n"
    "  return fetch(url)\n"
    "    .then((response) => response.json())\n"
    "    .then((user) => user.name);\n"
    "}\n"
)
_MINUTES = (
    "The committee met on Tuesday to review the budget. After a long discussion, the members agreed "
    "that the library would stay open on Sundays, that the park would get new benches, and that the "
    "bridge repairs would wait until spring."
)

# Answers that quote and edit their prompt: each prompt starts the edited copy.
QUOTING = (
    f"{_CODE}\n# The same function with `subtotal` renamed to `net`:\ndef total_price(items, tax_rate):\n    net = 0\n",
    f"{_CLASS}\n# The same class with `counts` renamed to `tally`:\nclass Counter:\n    def __init__(self):\n"
    "        self.tally = {}\n",
    f"{_JS}\n// The same function with `fetchUser` renamed to `loadUser`:\nfunction loadUser(id) {{\n",
    f"{_MINUTES}\n\nThe same paragraph, copied word for word:\n\nThe committee met",
)
ORDINARY = (
    "Once upon a time",
    "The three primary colors are",
    "Water boils at",
    "The best way to learn a new language is",
)


@dataclass(frozen=True)
class Workload:
    name: str  # "quoting" or "ordinary"
    plain_tok_s: float  # decode rate without speculation (tokens after the first / time after it)
    speculative_tok_s: float  # the same with the coordinator's --speculate
    ratio: float  # speculative over plain
    acceptance: float  # drafted tokens accepted / drafted
    tokens: int  # tokens generated per mode


@dataclass(frozen=True)
class SpeculateFigures:
    cpu: str
    speculate: int  # the coordinator's --speculate K
    stages: int
    new_tokens: int
    rounds: int
    quoting: Workload
    ordinary: Workload
    within_budget: dict[str, bool]  # quoting >= 1.8x, ordinary >= 0.95x


def _decode(client: Client, prompt: str, *, tokens: int, speculate: int) -> tuple[list[int], float]:
    """One greedy answer streamed: its tokens and the seconds from its first token to its last."""
    ids: list[int] = []
    first = last = 0.0
    for chunk in client.stream(prompt, max_tokens=tokens, temperature=0.0, speculate=speculate):
        if chunk.token_ids:
            last = time.perf_counter()
            first = first or last
            ids += chunk.token_ids
    return ids, last - first


def run_workload(
    client: Client, name: str, prompts: tuple[str, ...], *, tokens: int, speculate: int, rounds: int
) -> Workload:
    seconds = {0: 0.0, speculate: 0.0}
    decoded = {0: 0, speculate: 0}  # tokens after each answer's first
    before = client.cluster()
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            answers = {}
            for k in (0, speculate) if (r + i) % 2 == 0 else (speculate, 0):
                ids, took = _decode(client, prompt, tokens=tokens, speculate=k)
                answers[k] = ids
                seconds[k] += took
                decoded[k] += len(ids) - 1
            if answers[0] != answers[speculate]:
                raise RuntimeError(f"speculation changed the greedy answer to {prompt[:40]!r}...")
    after = client.cluster()
    drafted = after.spec_decode_draft_tokens - before.spec_decode_draft_tokens
    accepted = after.spec_decode_accepted_tokens - before.spec_decode_accepted_tokens
    plain, spec = decoded[0] / seconds[0], decoded[speculate] / seconds[speculate]
    generated = decoded[0] + rounds * len(prompts)
    return Workload(name, plain, spec, spec / plain, accepted / max(drafted, 1), generated)


def measure(
    checkpoint: Path,
    *,
    port: int,
    log_dir: Path,
    speculate: int = 8,
    stages: int = 1,
    dtype: str = "float32",
    new_tokens: int = 64,
    rounds: int = 2,
    log: Callable[[str], None] = print,
) -> SpeculateFigures:
    plan = ClusterPlan(
        model=str(checkpoint),
        stages=stages,
        dtype=dtype,
        port=port,
        log_dir=log_dir,
        coordinator_args=("--speculate", str(speculate), "--prefix-cache", "0"),
    )
    cluster = LocalCluster(plan, checkpoint)
    cluster.start()
    try:
        cluster.wait_ready()
        with cluster.client() as client:
            client.generate(ORDINARY[0], max_tokens=4, temperature=0.0)  # warm up
            workloads = []
            for name, prompts in (("quoting", QUOTING), ("ordinary", ORDINARY)):
                log(
                    f"{name}: {len(prompts)} prompts x {rounds} rounds of {new_tokens} tokens, "
                    f"speculate 0 and {speculate}"
                )
                workloads.append(
                    run_workload(client, name, prompts, tokens=new_tokens, speculate=speculate, rounds=rounds)
                )
    finally:
        cluster.stop()
    quoting, ordinary = workloads
    return SpeculateFigures(
        cpu=cpu_name(),
        speculate=speculate,
        stages=stages,
        new_tokens=new_tokens,
        rounds=rounds,
        quoting=quoting,
        ordinary=ordinary,
        within_budget={"quoting_speedup": quoting.ratio >= 1.8, "ordinary_speedup": ordinary.ratio >= 0.95},
    )


def table(figures: SpeculateFigures) -> str:
    lines = [
        f"CPU: {figures.cpu}; {figures.stages} stage(s), --speculate {figures.speculate}, "
        f"{figures.new_tokens} tokens a request, {figures.rounds} rounds",
        "| workload | plain tok/s | speculative tok/s | ratio | budget | drafted tokens accepted |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for w, budget in ((figures.quoting, ">= 1.8x"), (figures.ordinary, ">= 0.95x")):
        lines.append(
            f"| {w.name} | {w.plain_tok_s:.1f} | {w.speculative_tok_s:.1f} | {w.ratio:.2f}x | {budget} "
            f"| {100 * w.acceptance:.0f}% |"
        )
    return "\n".join(lines) + "\n"

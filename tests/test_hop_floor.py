"""The bare relay behind `layerline bench`'s hop floor: real processes, real gRPC on 127.0.0.1.

Its figures are timings, never asserted; what is asserted is that the relay is wired right: both
relays compute the same function, the 2-stage one across its hop, so they return the same tokens
(`measure_hop_floor` raises otherwise), a lone row or several a step, split as `layerline up
--stages 2` splits the layers.
"""

from __future__ import annotations

import socket
import statistics

import pytest

from layerline.bench.hop_floor import HopFloor, measure_hop_floor
from layerline.bench.relay_stage import Shapes, decode_tokens, encode_tokens

from .stage_client import free_ports
from .tiny_models import TINY_SHAPES


def test_shapes_of_a_config_give_the_fused_widths() -> None:
    assert Shapes.of(TINY_SHAPES) == Shapes(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=4, qkv_width=(4 + 2 * 2) * 8, o_width=4 * 8
    )


def test_a_step_carries_its_tokens_and_the_steps_left() -> None:
    assert encode_tokens([5, 70000]) == bytes([0, 0, 0, 0, 5, 0, 0, 0, 0x70, 0x11, 1, 0])
    assert decode_tokens(encode_tokens([5, 70000], 7)) == ([5, 70000], 7)
    assert decode_tokens(encode_tokens([], 3)) == ([], 3)


@pytest.mark.cluster
@pytest.mark.parametrize(("rows", "ring"), [(1, False), (3, False), (1, True), (3, True)])
def test_both_relays_return_the_same_tokens_over_the_split_of_layerline_up(rows: int, ring: bool) -> None:
    """On a ring the stages go on from their own tokens (20 steps: blocks of 8, 8 and 4 from the
    driver's one message each); the relays still agree token for token."""
    rounds = []
    floor = measure_hop_floor(
        TINY_SHAPES,
        rounds=2,
        tokens=20,
        port=free_ports(3),
        rows=rows,
        ring=ring,
        env={"OMP_NUM_THREADS": "1"},
        log=rounds.append,
    )
    assert isinstance(floor, HopFloor)
    assert floor.layer_ranges == [(0, 2), (2, 4)]  # the LM head weighs a third of a layer here
    assert (floor.rounds, floor.tokens, floor.rows, floor.ring) == (2, 20, rows, ring)
    assert len(rounds) == 2 and rounds[0].startswith(f"hop floor round 1/2, {rows} row")
    assert (" ring, " in rounds[0]) == ring
    assert floor.one_stage_gap_ms > 0 and floor.two_stages_gap_ms > 0
    # The hop is the median of the rounds' own differences (each round's relays took turns), as each round logs it.
    logged = [float(line.split(": ")[-1].removesuffix(" ms a hop")) for line in rounds]
    assert floor.added_ms_per_hop_rounds == pytest.approx(logged, abs=0.006)
    assert floor.added_ms_per_hop == pytest.approx(statistics.median(floor.added_ms_per_hop_rounds))
    assert len(floor.two_vs_one_stage_rounds) == 2
    assert floor.two_vs_one_stage == pytest.approx(statistics.median(floor.two_vs_one_stage_rounds))


@pytest.mark.cluster
def test_a_relay_stage_that_cannot_listen_is_named_not_waited_for() -> None:
    base = free_ports(3)
    with socket.socket() as taken:  # the 2-stage relay's first stage finds its port taken
        taken.bind(("127.0.0.1", base + 1))
        taken.listen()
        with pytest.raises(RuntimeError, match=f"the bare relay stage on port {base + 1} exited with code 1"):
            measure_hop_floor(TINY_SHAPES, rounds=1, tokens=4, port=base)


@pytest.mark.cluster
def test_a_round_of_one_step_is_measured_by_that_step() -> None:
    """Each block's first step is left out of the medians, unless it is all a round has."""
    floor = measure_hop_floor(TINY_SHAPES, rounds=1, tokens=1, port=free_ports(3), rows=2, dtype="bfloat16")
    assert floor.one_stage_gap_ms > 0 and floor.two_stages_gap_ms > 0
    assert len(floor.two_vs_one_stage_rounds) == 1

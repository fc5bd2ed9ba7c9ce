"""`--quantize int8 | int4`: the quantized layers' products, a stage built of them, its memory,
bad values, and the accuracy of the real model against float32."""

from __future__ import annotations

import pytest
import torch

from layerline.shared.cpu import cpu_flags, is_x86
from layerline.shared.model_config import LayerRange
from layerline.stage_worker.parallel import TensorParallel
from layerline.stage_worker.quantize import (
    DEQUANTIZED_DTYPE,
    DEQUANTIZED_ROWS,
    INT4_GROUP,
    KERNEL_ROWS,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    QuantizeError,
    dequantized_rows,
)
from layerline.stage_worker.settings import StageSettings
from layerline.stage_worker.weights import load_stage

from .pipeline import LocalPipeline
from .tiny_models import make_tiny_checkpoint

LAYERS = {"int8": Int8Linear, "int4": Int4Linear}


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def test_many_rows_multiply_in_bfloat16_only_where_the_cpu_has_its_instructions() -> None:
    """oneDNN says it multiplies bfloat16 on any AVX-512 CPU and emulates it where the instructions
    are missing, at up to 3 times float32's time: on x86 the CPU's flags decide, this machine's
    too (an AVX-512 Xeon without AVX512_BF16 multiplied in bfloat16 before)."""
    avx512 = frozenset({"sse2", "avx2", "avx512f", "avx512_vnni"})
    for bf16 in ({"avx512_bf16"}, {"amx_bf16", "amx_tile"}):
        assert dequantized_rows(onednn_bfloat16=True, x86=True, flags=avx512 | bf16) == (32, torch.bfloat16)
    assert dequantized_rows(onednn_bfloat16=True, x86=True, flags=avx512) == (128, torch.float32)
    assert dequantized_rows(onednn_bfloat16=True, x86=True, flags=frozenset()) == (128, torch.float32)  # flags unknown
    assert dequantized_rows(onednn_bfloat16=False, x86=True, flags=avx512 | {"avx512_bf16"}) == (128, torch.float32)
    assert dequantized_rows(onednn_bfloat16=True, x86=False, flags=frozenset()) == (32, torch.bfloat16)  # oneDNN's word
    if is_x86() and torch.backends.mkldnn.is_available():
        has = bool({"avx512_bf16", "amx_bf16"} & cpu_flags()) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        assert (DEQUANTIZED_ROWS, DEQUANTIZED_DTYPE) == ((32, torch.bfloat16) if has else (128, torch.float32))


@pytest.mark.parametrize("rows", sorted({1, 3, 17, KERNEL_ROWS, DEQUANTIZED_ROWS - 1, DEQUANTIZED_ROWS, 300}))
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_layer_multiplies_by_its_dense_weight(scheme, rows):
    """The kernel's product equals x W'^T + b, W' the dequantized weight, up to the rounding of x
    and of the result to bfloat16 (torch's kernels' dtype; layerline's int8 and int4 kernels take
    a few float32 rows unrounded): within 1/128 of the largest output. 40
    output channels: int4 pads them to 48 and cuts the padding off. From DEQUANTIZED_ROWS rows on,
    int8 multiplies by its codes made DEQUANTIZED_DTYPE instead of calling the kernel."""
    torch.manual_seed(0)
    weight, bias, x = torch.randn(40, 64), torch.randn(40), torch.randn(rows, 64)
    layer = LAYERS[scheme](weight, bias)
    want = x.bfloat16().float() @ layer.dense().t() + bias
    got = layer(x)
    assert got.shape == (rows, 40) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=want.abs().max().item() / 128)


def test_int8_weights_are_within_half_a_step_of_float32():
    torch.manual_seed(1)
    weight = torch.randn(40, 64) * torch.logspace(-3, 1, 40)[:, None]  # rows of very different sizes
    layer = Int8Linear(weight, None)
    step = layer.scales.float()[:, None]  # [out, 1]
    assert torch.all((layer.dense() - weight).abs() <= step / 2 * (1 + 1e-3))
    assert layer.weight_int8.dtype == torch.int8 and layer.weight_int8.abs().max() == 127


def test_int4_weights_are_within_a_step_of_float32():
    """Each group of 32 inputs has its own step (scale); the offset rounded to bfloat16 may move
    the codes by part of one, so the bound is 0.6 of a step."""
    torch.manual_seed(2)
    weight = torch.randn(48, 128) * torch.logspace(-3, 1, 128)[None, :]  # groups of very different sizes
    layer = Int4Linear(weight, None)
    step = layer.scales_and_zeros[..., 0].float().t().repeat_interleave(INT4_GROUP, dim=1)  # [out, in]
    assert torch.all((layer.dense() - weight).abs() <= 0.6 * step)


@pytest.mark.parametrize(("scheme", "limit"), [("int8", 0.02), ("int4", 0.12)])
def test_quantized_product_is_close_to_float32(scheme, limit):
    """On Gaussian weights the relative error of the product: about 0.8% for int8 (255 steps per
    row), 8% for int4 (15 steps per group of 32); the limits leave room above those."""
    torch.manual_seed(3)
    weight, x = torch.randn(256, 576), torch.randn(8, 576)
    got = LAYERS[scheme](weight, None)(x)
    assert _relative_error(got, x @ weight.t()) < limit


class _SummedElsewhere(TensorParallel):
    """Rank 1 of 2, whose sum over the ranks is left out: what this rank adds is what it returns."""

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t


def test_int8_embedding_returns_its_rows_and_zero_for_other_ranks_ids():
    torch.manual_seed(4)
    weight = torch.randn(10, 8)  # rows 20..29 of the vocabulary
    embed = Int8Embedding(weight, start=20, tp=_SummedElsewhere(rank=1, size=2))
    assert torch.all((embed.dense() - weight).abs() <= embed.scales.float()[:, None] / 2 * (1 + 1e-3))
    got = embed(torch.tensor([21, 3, 29, 30]))
    torch.testing.assert_close(got[[0, 2]], embed.dense()[[1, 9]], rtol=0, atol=0)
    assert torch.all(got[[1, 3]] == 0)
    whole = Int8Embedding(weight, start=0, tp=TensorParallel())
    torch.testing.assert_close(whole(torch.tensor([1, 9])), embed.dense()[[1, 9]], rtol=0, atol=0)


def test_int4_refuses_an_input_width_it_cannot_group():
    with pytest.raises(QuantizeError, match="int4 needs an input width that is a multiple of 32, got 48"):
        Int4Linear(torch.randn(16, 48), None)


@pytest.fixture(scope="module", params=["llama3", "llama2"])  # llama2: biases on q/k/v/o and the MLP
def tiny64(request, tmp_path_factory):
    """A tiny model whose widths int4 can group (64 hidden, 128 intermediate)."""
    out = tmp_path_factory.mktemp(f"{request.param}64")
    hf = make_tiny_checkpoint(request.param, out, hidden_size=64, intermediate_size=128)
    return out, hf


def _dequantized_oracle(hf, stage):
    """transformers' model with each linear weight replaced by the one the stage's quantized
    layer multiplies by (q, k, v and gate, up cut back out of the fused rows)."""
    import copy

    oracle = copy.deepcopy(hf)
    with torch.no_grad():
        oracle.model.embed_tokens.weight.copy_(stage.embed_tokens.dense())
        for i, layer in stage.layers.items():
            attn, mlp = oracle.model.layers[int(i)].self_attn, oracle.model.layers[int(i)].mlp
            q, k, v = (
                stage.layers[i]
                .self_attn.qkv_proj.dense()
                .split([attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features])
            )
            attn.q_proj.weight.copy_(q), attn.k_proj.weight.copy_(k), attn.v_proj.weight.copy_(v)
            attn.o_proj.weight.copy_(layer.self_attn.o_proj.dense())
            gate, up = layer.mlp.gate_up_proj.dense().chunk(2)
            mlp.gate_proj.weight.copy_(gate), mlp.up_proj.weight.copy_(up)
            mlp.down_proj.weight.copy_(layer.mlp.down_proj.dense())
        oracle.lm_head = torch.nn.Linear(64, stage.config.vocab_size, bias=False)  # untied from the embedding
        oracle.lm_head.weight.copy_(stage.lm_head.dense())
    return oracle


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_stage_computes_transformers_with_its_dequantized_weights(tiny64, scheme):
    """A whole quantized stage (fused qkv and gate_up, biases, the int8 head and embedding) gives the logits of
    transformers' model holding the dequantized weights, up to the bfloat16 rounding of each
    layer's input: within 2% of the largest logit. Its layers are the quantized ones."""
    path, hf = tiny64
    stage = load_stage(path, LayerRange(0, 4), quantize=scheme)
    kinds = [type(m).__name__ for m in stage.modules() if isinstance(m, (Int8Linear, Int4Linear))]
    assert kinds.count(LAYERS[scheme].__name__) == 4 * 4 + (scheme == "int8")  # qkv, o, gate_up, down; the head
    assert isinstance(stage.lm_head, Int8Linear) and isinstance(stage.embed_tokens, Int8Embedding)
    ids = [1, 17, 42, 99, 3, 5, 8, 13, 21, 34, 55, 89, 144]
    with torch.no_grad():
        want = _dequantized_oracle(hf, stage)(torch.tensor([ids])).logits[0].float()
    got = LocalPipeline([stage]).step({"s": ids}, all_logits=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0.02 * want.abs().max().item())


def _linear_bytes(out_features: int, in_features: int, scheme: str) -> int:
    """Bytes of one quantized [out, in] weight with its scales (no bias)."""
    if scheme == "int8":
        return out_features * in_features + 2 * out_features  # int8 codes, bfloat16 scales
    padded = -(-out_features // 16) * 16
    return padded * in_features // 2 + (in_features // INT4_GROUP) * padded * 2 * 2  # 2 codes a byte; scale, zero


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_stage_weights_bytes_shrink_by_the_expected_amount(tiny64, scheme):
    """What a stage worker reports as `weights_bytes`: each linear weight's and the embedding's
    float32 bytes give way to its codes and scales; the norms and biases stay float32."""
    from layerline.stage_worker.server import StageWorker

    path, _ = tiny64
    sizes = {}
    for quantize in ("none", scheme):
        worker = StageWorker(StageSettings(model=str(path), layers="0:4", quantize=quantize, weight_layout="plain"))
        worker.load()
        sizes[quantize] = worker.weights_bytes
    config = worker.config
    heads, kv, d = config.num_heads, config.num_kv_heads, config.head_dim
    linears = [((heads + 2 * kv) * d, 64), (64, heads * d), (256, 64), (64, 128)]  # qkv, o, gate_up, down
    saved = 4 * sum(4 * o * i - _linear_bytes(o, i, scheme) for o, i in linears)
    saved += 2 * (4 * config.vocab_size * 64 - _linear_bytes(config.vocab_size, 64, "int8"))  # head, embedding
    assert sizes["none"] - sizes[scheme] == saved


def test_quantized_stages_advertise_a_model_id_of_their_own(tiny64):
    """The coordinator chains only workers of one model id: never a quantized stage with a float
    one, nor int8 with int4."""
    from layerline.stage_worker.weights import model_id

    path, _ = tiny64
    ids = {scheme: model_id(path, quantize=scheme) for scheme in ("none", "int8", "int4")}
    assert len(set(ids.values())) == 3
    assert ids["none"] == model_id(path) and ids["int8"] == model_id(path, quantize="int8")


def test_bad_quantize_values_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--quantize 'int3' is not one of none, int8, int4"):
        StageSettings(model="m", layers="0:1", quantize="int3")
    make_tiny_checkpoint("llama3", tmp_path)  # 48 wide: int4 cannot group it
    with pytest.raises(ValueError, match="quantize 'fp8' is not one of none, int8, int4"):
        load_stage(tmp_path, LayerRange(0, 4), quantize="fp8")
    with pytest.raises(
        QuantizeError, match=r"--quantize int4: layers\.0\.self_attn\.qkv_proj \[out 96, in 48\]: .* multiple of 32"
    ):
        load_stage(tmp_path, LayerRange(0, 4), quantize="int4")


def test_stage_command_refuses_a_bad_quantize(capsys):
    from layerline.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["stage", "--model", "m", "--layers", "0:1", "--quantize", "int3"])
    assert exited.value.code == 2
    err = capsys.readouterr().err  # the choices are quoted from Python 3.12 on
    assert "argument --quantize: invalid choice: 'int3' (choose from" in err
    assert all(choice in err for choice in ("none", "int8", "int4"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_layer_on_cuda_multiplies_by_its_dense_weight(scheme):
    torch.manual_seed(0)
    weight, x = torch.randn(40, 64, device="cuda"), torch.randn(5, 64, device="cuda")
    layer = LAYERS[scheme](weight, None)
    want = x.bfloat16().float() @ layer.dense().t()
    torch.testing.assert_close(layer(x), want, rtol=0, atol=want.abs().max().item() / 128)


@pytest.fixture(scope="module")
def held_greedy(hf_real, hf_greedy) -> dict[str, tuple[list[int], list[int]]]:
    """The held prompts' ids and transformers' 32 greedy float32 tokens after each, made once."""
    from layerline.bench.quantize import HELD_PROMPTS

    tok, _ = hf_real
    held = {}
    for i, prompt in enumerate(HELD_PROMPTS):
        ids = tok(prompt)["input_ids"]
        held[str(i)] = (ids, hf_greedy(ids, 32))
    return held


@pytest.mark.real_model
@pytest.mark.timeout(600)
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_real_model_agrees_with_float32_greedy_tokens(real_model_dir, held_greedy, scheme):
    """8 held prompts x 32 tokens, teacher-forced: at each position, the quantized model's argmax
    is float32's greedy token (transformers') at 95% of the 256 positions or more. Measured on an
    Intel Xeon (AVX-512): int8 246 of 256 (96.1%), int4 249 (97.3%)."""
    from layerline.bench.quantize import agreement

    held = held_greedy
    stage = load_stage(real_model_dir, LayerRange(0, 30), quantize=scheme)
    agree, total = agreement(stage, held)
    assert total == 256
    assert agree >= 0.95 * total, f"{scheme}: {agree} of {total} positions agree"
    # One token a step, as a lone stream decodes: the row path (int8's compiled kernel where it serves).
    by_token, _ = agreement(stage, held, by_token=True)
    assert by_token >= 0.95 * total, f"{scheme}, one token a step: {by_token} of {total} positions agree"


@pytest.mark.real_model
@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_up_with_quantize_int8_serves_the_quantized_tokens_and_reports_its_weights(real_model_dir, hf_real, tmp_path):
    """`up --quantize int8` reaches every stage worker: ClusterStatus reports each one's weights at
    under a third of float32's (about a quarter: int8 codes, scales, float32 norms), and a greedy
    answer is the token ids of the same quantized stages run in this process."""
    from layerline.client import Client
    from layerline.launcher import ClusterPlan, LocalCluster

    from .stage_client import free_port

    plan = ClusterPlan(
        model=str(real_model_dir), stages=2, quantize="int8", port=free_port(), log_dir=tmp_path, kv_memory="64M"
    )
    local = LocalCluster(plan, real_model_dir)
    local.start()
    try:
        local.wait_ready(timeout=300)
        with Client(local.address) as client:
            workers = sorted(client.cluster().workers, key=lambda w: w.layers)
            got = client.generate("The three primary colors are", max_tokens=16, temperature=0.0).token_ids
    finally:
        local.stop()
    tok, _ = hf_real
    stages = []
    for worker in workers:
        start, end = worker.layers
        stages.append(load_stage(real_model_dir, LayerRange(start, end), quantize="int8"))
        float32 = load_stage(real_model_dir, LayerRange(start, end), weight_layout="plain")
        held = {id(t): t for t in float32.state_dict(keep_vars=True).values()}
        assert worker.weights_bytes < sum(t.numel() * t.element_size() for t in held.values()) / 3
    ids = tok("The three primary colors are")["input_ids"]
    assert list(got) == LocalPipeline(stages).greedy({"p": ids}, 16)["p"]

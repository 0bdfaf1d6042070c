"""Our forward against Hugging Face transformers' on the same random weights (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from aserve import LLM, SamplingParams
from aserve.engine import engine as engine_module
from aserve.engine.step import forward_batch
from aserve.layers.cpu_gemm import can_pack
from aserve.quant.native import FloatWeight, native_kernels
from aserve.scheduler.batch import step_images, step_spec
from aserve.scheduler.request import FinishReason
from tests.tiny_models import FAMILIES, hf_greedy_tokens, make_tiny_model

PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 12, 250, 31, 8], [300, 4, 4, 61]]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def hf_model(folder: Path) -> torch.nn.Module:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def our_logits(
    llm: LLM,
    prompt: list[int],
    continuation: list[int],
    images: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Logits after the prompt and after each teacher-forced continuation token, computed
    through the planner, the page table and the attention backend as a real run would
    (the prompt in chunks where `llm` cuts it: only the last one gives a row; `images`, the
    pixels of its image tokens, reach the model where a real run's would)."""
    scheduler, engine = llm.scheduler, llm.runtime.engine
    params = SamplingParams(max_tokens=len(continuation) + 1)
    req = scheduler.make_request(prompt, params, images)
    scheduler.planner.add(req)
    rows = []
    tokens = iter([*continuation, None])
    while True:
        planned = scheduler.planner.schedule()
        assert planned is not None and planned.reqs == [req]
        images_taken = step_images(planned)
        spec = step_spec(planned, engine.page_table, images=images_taken)
        batch = forward_batch(spec, engine.page_table, engine.device)
        if images_taken is not None:
            engine.attach_images(batch, images_taken.pieces)
        engine.attn.prepare(batch)
        logits = engine.model(batch, engine.attn)[0]
        if not planned.samples[0]:  # a chunk short of the prompt's end
            scheduler.planner.complete(planned, [0])
            continue
        rows.append(logits)
        token = next(tokens)
        if token is None:
            break
        engine.page_table.tokens[req.slot, batch.seq_lens[0]] = token
        scheduler.planner.complete(planned, [token])
    scheduler.planner.finish(req, FinishReason.ABORT)
    return torch.stack(rows)


def assert_logits_match(llm: LLM, hf: torch.nn.Module) -> None:
    """Our float32 logits of each prompt's prefill and five decode steps equal transformers'."""
    for prompt in PROMPTS:
        continuation = [7, 123, 45, 2, 99]
        ours = our_logits(llm, prompt, continuation)
        with torch.inference_mode():
            theirs = hf(torch.tensor([prompt + continuation])).logits[0, len(prompt) - 1 :]
        torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)
    llm.scheduler.check_integrity()


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch"])
def test_logits_match_transformers(
    tiny: Path, kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CPU float weights run on aserve's kernels (`FloatWeight`) where they build, and
    otherwise (or for dummy and MoE weights) on torch's path, MKL-packed: both match."""
    if not kernels:
        monkeypatch.setattr(engine_module, "float_weights_on_kernels", lambda *args: None)
    elif not native_kernels():
        pytest.skip("the CPU kernels do not build here")
    hf = hf_model(tiny)
    with LLM(str(tiny), page_size=4) as llm:
        assert_logits_match(llm, hf)
        engine = llm.runtime.engine
        on_kernels = engine.model_config.quantization == "float32"
        assert on_kernels == (kernels and not engine.model_config.num_experts)
        head = engine.model.lm_head
        tied = head is engine.model.model.embed_tokens
        if on_kernels:  # one float32 copy serves the head's product and the lookups
            assert head.table is not None and isinstance(head.table.head, FloatWeight)
            assert (head.table.lookups is head.table.head) == tied
        elif can_pack(torch.empty(1)):  # so the match above covers the packed LM head
            assert head.packed is not None and not hasattr(head, "weight")
            assert (head.lookup_table is not None) == tied


def test_a_batch_halfway_event_is_recorded_after_half_the_layers(tiny: Path) -> None:
    """The scheduler plans behind a prefill once the GPU passes `ForwardBatch.halfway`: the
    model records it once, with the first half of its layers queued and the rest not."""
    with LLM(str(tiny), page_size=4) as llm:
        scheduler, engine = llm.scheduler, llm.runtime.engine
        layers = engine.model.model.layers
        ran: list[int] = []
        hooks = [
            layer.register_forward_pre_hook(lambda _m, _a, i=i: ran.append(i))
            for i, layer in enumerate(layers)
        ]

        recorded_after: list[list[int]] = []

        class Marker:
            def record(self) -> None:
                recorded_after.append(list(ran))

        req = scheduler.make_request(PROMPTS[0], SamplingParams(max_tokens=1))
        scheduler.planner.add(req)
        planned = scheduler.planner.schedule()
        assert planned is not None
        batch = forward_batch(
            step_spec(planned, engine.page_table), engine.page_table, engine.device
        )
        batch.halfway = Marker()  # type: ignore[assignment]
        engine.forward(batch)
        for hook in hooks:
            hook.remove()
        scheduler.planner.finish(req, FinishReason.ABORT)
        assert len(layers) >= 2 and ran == list(range(len(layers)))
        assert recorded_after == [list(range(len(layers) // 2))]


def test_tied_head_without_checkpoint_stays_plain(tiny: Path) -> None:
    """Dummy weights have no checkpoint table to serve a tied head's lookups from."""
    with LLM(str(tiny), dummy_weight=True) as llm:
        model = llm.runtime.engine.model
        if model.lm_head is model.model.embed_tokens:
            assert model.lm_head.packed is None and model.lm_head.lookup_table is None
        out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out[0].token_ids) == 3


def test_greedy_matches_transformers_generate(tiny: Path) -> None:
    hf = hf_model(tiny)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(tiny), page_size=1) as llm:
        outputs = llm.generate(PROMPTS, params)
        llm.scheduler.check_integrity()
    for prompt, out in zip(PROMPTS, outputs):
        expected = hf_greedy_tokens(hf, prompt, 12)
        assert out.token_ids == expected
        assert out.finish_reason == "length"


@pytest.mark.parametrize("rows", [1, 3, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_cpu_weight_equals_plain_linear(rows: int, bias: bool) -> None:
    """The packed weight serves every row count, not only the one it was packed for (the
    op's fallback for other counts would read the all-zero stand-in and give zeros)."""
    from aserve.layers.cpu_gemm import PackedWeight

    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=generator)
    if not can_pack(weight):
        pytest.skip("this torch build has no MKL (packing is x86-only)")
    b = torch.randn(96, generator=generator) if bias else None
    x = torch.randn(rows, 64, generator=generator)
    packed = PackedWeight(weight)
    torch.testing.assert_close(packed.linear(x, b), F.linear(x, weight, b))
    torch.testing.assert_close(packed.linear(x[None], b)[0], F.linear(x, weight, b))


@pytest.mark.parametrize(
    ("keys", "windows", "unrotated"),
    [
        ({"sliding_window": None}, (), ()),  # EXAONE 4 1.2B: every layer whole and rotated
        ({"sliding_window": 4096, "sliding_window_pattern": 4}, (4096,) * 3 + (0,), (3,)),
        ({"sliding_window": 4096, "sliding_window_pattern": "LLGL"}, (4096, 4096, 0, 4096), (2,)),
        ({"sliding_window": 4096, "layer_types": ["full_attention"] * 4}, (0,) * 4, (0, 1, 2, 3)),
    ],
)
def test_exaone4_windows_and_unrotated_layers_follow_transformers(
    keys: dict[str, object], windows: tuple[int, ...], unrotated: tuple[int, ...]
) -> None:
    """With a window in its config, EXAONE 4's layers that do not read it take no rotary
    position (transformers' rule, whatever the pattern); without one, all rotate."""
    from aserve.config import ModelConfig

    config = {
        "architectures": ["Exaone4ForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "vocab_size": 320,
        **keys,
    }
    model = ModelConfig.from_hf(config)
    assert model.post_norms and model.qk_norm and not model.qk_norm_across_heads
    assert model.layer_windows == (windows if any(windows) else ())
    assert model.rope_free_layers == unrotated

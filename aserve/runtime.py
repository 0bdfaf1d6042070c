"""Build tokenizer, engine and scheduler from a config: what llm.py, the server and the shell
start and stop."""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aserve.config import (
    CHECKPOINT_METHODS,
    ENCODER_ARCHITECTURES,
    ConfigError,
    EngineConfig,
    ModelConfig,
    ServerConfig,
    with_overrides,
)
from aserve.constrained.grammar import GrammarCompiler
from aserve.engine.followers import start_engine
from aserve.engine.memory import GiB, free_device_memory
from aserve.generation_defaults import describe, resolve_defaults
from aserve.images import ImageProcessor, grid_token_names
from aserve.models.pooling import read_pooling
from aserve.models.source import complete_tokenizer, resolve_model
from aserve.models.vision import frame_image, image_support
from aserve.models.weights import load_hf_config
from aserve.scheduler.scheduler import Scheduler
from aserve.tokenizer import Tokenizer, has_tokenizer

logger = logging.getLogger(__name__)


def freeze_startup_objects() -> None:
    """Take what start-up built (model, tokenizer, graphs: millions of objects) out of the
    garbage collector's sight. Otherwise every full collection walks all of it: measured at
    up to 130 ms with SmolLM2 on a laptop CPU, a stall of every stream and of the GPU."""
    gc.collect()
    gc.freeze()


def import_before_threads() -> None:
    """Import torch's extension builder, and with it setuptools, while start-up has one thread.

    setuptools' import puts a finder at the front of `sys.meta_path` and takes it out again
    (its distutils shim). Python walks that list live, so a thread importing at that moment
    can skip the path finder and not find an installed package: the tokenizer's thread failed
    now and then with "No module named 'packaging'" inside `import transformers` while the
    engine's thread built the CPU kernels (FlashInfer's builder threads import the same on a
    GPU). Imported here it costs ~0.1 s, which the kernels' build paid anyway."""
    from torch.utils import cpp_extension  # noqa: F401


def chosen_quantization(engine: EngineConfig, model: ModelConfig) -> str | None:
    """What the weights run as: the checkpoint's own format (`auto`, and `fp8` for an FP8
    checkpoint; dummy weights are float), float (`none`), or a float checkpoint quantized at
    load (`int8`, `int4`, `fp8`). `fp8` also takes a GGUF file's weights, de-quantized, into
    FP8: on a GPU its MoE experts then run in the fused FP8 kernels, at a byte a weight
    where the file's codes take about half that and run a little slower."""
    stored = model.quantization
    if stored not in (None, "gguf", "fp8"):
        raise ConfigError(
            f"{stored} checkpoints are not supported: aserve runs GGUF files, FP8 checkpoints "
            "and integer ones (AWQ, GPTQ, compressed-tensors) quantized, and float checkpoints "
            "(quantized at load with --quantization int8, int4 or fp8)"
        )
    requested = engine.quantization
    scheme = model.int_scheme
    if requested in CHECKPOINT_METHODS:
        if scheme is None or scheme.method != CHECKPOINT_METHODS[requested]:
            raise ConfigError(
                f"--quantization {requested} names the checkpoint's own method, and this "
                f"checkpoint is not {CHECKPOINT_METHODS[requested]}: pass --quantization auto"
            )
        requested = "auto"
    if requested == "none" or (requested == "auto" and engine.dummy_weight):
        return None
    if requested == "auto" or requested == stored == "fp8":  # vLLM users pass fp8 for both
        chosen = stored
    elif stored == "gguf" and requested == "fp8":
        chosen = "fp8"
    elif stored is not None:
        kind = "FP8" if stored == "fp8" else "MXFP4" if model.mxfp4_checkpoint else "GGUF"
        if scheme is not None:
            kind = {"awq": "AWQ", "gptq": "GPTQ"}.get(scheme.method, scheme.method)
        raise ConfigError(
            f"--quantization {requested} quantizes a float checkpoint at load; this one is "
            f"already quantized ({kind}): pass --quantization auto or none"
            + (" (or fp8, on a GPU)" if stored == "gguf" else "")
        )
    else:
        chosen = requested
    if chosen is not None and model.num_experts and chosen not in ("fp8", "gguf"):
        raise ConfigError(
            "MoE experts run quantized as a GGUF file stores them or in FP8 (an FP8 "
            "checkpoint, or --quantization fp8 of a float one): pass that, or --quantization "
            "none to run this model in --dtype"
        )
    return chosen


def classifier_token_ids(model_dir: Path, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """The vocabulary ids of `classifier_from_token`'s tokens (vLLM looks them up alike)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as error:
        raise ConfigError(f"classifier_from_token needs the model's tokenizer: {error}") from None
    ids = []
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ConfigError(f"classifier_from_token: {token!r} is not a token of this model")
        ids.append(int(token_id))
    return tuple(ids)


def separator_id(model_dir: Path) -> int:
    """The id of the token that ends a pair's first sequence ([SEP]), for an encoder's
    classifier whose second sequence takes token type 1."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as error:
        raise ConfigError(f"a BERT classifier needs the model's tokenizer: {error}") from None
    if tokenizer.sep_token_id is None:
        raise ConfigError("a BERT classifier's tokenizer has no separator token ([SEP])")
    return int(tokenizer.sep_token_id)


class Runtime:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.model_dir = resolve_model(config.engine.model_path, tokenizer=False)
        hf_config, generation_config = load_hf_config(self.model_dir)
        hf_config = with_overrides(hf_config, config.engine.hf_overrides)
        self.model_config = ModelConfig.from_hf(hf_config, generation_config)
        owner = self.model_config.language_model_of
        if owner is not None and image_support(hf_config, owner) is not None:
            logger.info(
                "serving the language model of %s (%s) without its vision encoder: requests "
                "take text alone",
                self.model_config.language_model_of,
                self.model_config.architecture,
            )
        if config.engine.is_embedding:
            read_pooling(self.model_dir)  # refuses a pooling aserve does not compute
        elif self.model_config.bidirectional and not self.model_config.classifies:
            architecture = self.model_config.architecture
            what = (
                f"{architecture}, an encoder,"
                if architecture in ENCODER_ARCHITECTURES
                else f"{architecture.removesuffix('ForCausalLM')}'s text model here"
            )
            raise ConfigError(
                f"{what} attends both ways: it only embeds (start it with --is-embedding)"
            )
        if self.model_config.classifies and self.model_config.type_vocab_size > 1:
            self.model_config = dataclasses.replace(
                self.model_config, segment_separator_id=separator_id(self.model_dir)
            )
        if self.model_config.classifier_tokens:
            self.model_config = dataclasses.replace(
                self.model_config,
                classifier_token_ids=classifier_token_ids(
                    self.model_dir, self.model_config.classifier_tokens
                ),
            )
        quantization = chosen_quantization(config.engine, self.model_config)
        self.model_config = dataclasses.replace(self.model_config, quantization=quantization)
        self.sampling_defaults, origin = resolve_defaults(
            config, generation_config, embedded=config.engine.model_path is None
        )
        # The tokenizer (transformers' import alone is 2.4 s on the GPU machine) loads in a
        # thread while the engine starts: neither needs the other.
        import_before_threads()
        with ThreadPoolExecutor(1, thread_name_prefix="tokenizer-load") as loader:
            tokenizer = loader.submit(self._load_tokenizer, config.num_tokenizer)
            try:
                self.engine, self.followers = start_engine(
                    config.engine, self.model_config, self.model_dir
                )
            except BaseException:
                if tokenizer.exception() is None and tokenizer.result() is not None:
                    tokenizer.result().close()
                raise
            try:
                self.tokenizer = tokenizer.result()
            except BaseException:
                if self.followers is not None:
                    self.followers.close()
                raise
        # A GPU with little memory may have made the engine take smaller batches.
        fitted = self.engine.config
        config = self.config = dataclasses.replace(
            config,
            scheduler=dataclasses.replace(
                config.scheduler,
                max_running_requests=fitted.max_running_requests,
                max_prefill_length=fitted.max_prefill_length,
            ),
        )
        grammars = (
            None
            if self.tokenizer is None
            else GrammarCompiler(
                self.tokenizer,
                self.model_config.vocab_size,
                frozenset(self.model_config.eos_token_ids),
            )
        )
        self.scheduler = Scheduler(self.engine, config.scheduler, self.followers, grammars)
        self.image_processor = self._image_processor()
        if self.followers is not None:
            self.followers.on_failure = self.scheduler.fail
        freeze_startup_objects()
        logger.info("model ready: %s (%s)", self.model_dir, self.engine.describe())
        logger.info(self.capacity_line())
        logger.info(
            "default sampling: %s (from %s); requests that set a field keep theirs",
            describe(self.sampling_defaults),
            origin,
        )

    def _image_processor(self) -> ImageProcessor | None:
        """The checkpoint's image processor where the engine runs its images; None where it
        has none (preprocessor_config.json), with a log line: prompts then take pixels
        alone (the offline API's tensors), not images. A grid tower's row-end tokens are
        looked up here, in the tokenizer."""
        encoder = self.engine.images
        if encoder is None:
            return None
        if encoder.grid_cell is not None:
            names = grid_token_names(self.model_dir)
            vocab = {} if self.tokenizer is None else self.tokenizer.hf.get_vocab()
            if all(name in vocab for name in names):
                encoder.grid_token_ids = (vocab[names[0]], vocab[names[1]])
            else:
                logger.warning("the tokenizer lacks %s: images are refused", " or ".join(names))
        if encoder.both_ways:
            vocab = {} if self.tokenizer is None else self.tokenizer.hf.get_vocab()
            lacking = frame_image(encoder, vocab)
            if lacking is not None:
                logger.warning("the tokenizer lacks %s: images are refused", lacking)
        if not (self.model_dir / "preprocessor_config.json").is_file():
            logger.warning("no preprocessor_config.json: images are taken as pixel tensors only")
            return None
        return ImageProcessor(self.model_dir, encoder.grid_cell)

    def _load_tokenizer(self, num_threads: int) -> Tokenizer | None:
        started = time.perf_counter()
        if complete_tokenizer(self.model_dir, apart=True):  # the first start from a GGUF
            logger.info("tokenizer: written from the GGUF in %.1f s", time.perf_counter() - started)
            started = time.perf_counter()
        if not has_tokenizer(self.model_dir):
            return None
        tokenizer = Tokenizer(self.model_dir, num_threads)
        if self.config.chat_template is not None:  # --chat-template
            tokenizer.hf.chat_template = self.config.chat_template
        logger.info("tokenizer: loaded in %.1f s", time.perf_counter() - started)
        return tokenizer

    def capacity_line(self) -> str:
        """The start-up line SGLang users read to see what fits, with SGLang's names."""
        engine = self.engine
        free = free_device_memory(engine.device) / GiB
        where = "gpu" if engine.device.type == "cuda" else "host"
        return (
            f"max_total_num_tokens={(engine.num_pages - 1) * engine.config.page_size}, "
            f"chunked_prefill_size={self.config.scheduler.max_prefill_length}, "
            f"max_running_requests={self.config.scheduler.max_running_requests}, "
            f"context_len={engine.max_seq_len}, available_{where}_mem={free:.2f} GB"
        )

    def close(self) -> None:
        """Release everything; call it once the scheduler loop has ended (or never ran),
        since stopping the tensor-parallel workers ends the steps they can follow."""
        self.scheduler.stop()
        if self.tokenizer is not None:
            self.tokenizer.close()
        if self.followers is not None:
            self.engine.graphs = None
            self.followers.close()

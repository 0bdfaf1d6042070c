"""Build tokenizer, engine and scheduler from a config: what llm.py, the server and the shell
start and stop."""

from __future__ import annotations

import logging
import time

from aserve.config import ModelConfig, ServerConfig
from aserve.engine.engine import Engine
from aserve.models.source import resolve_model
from aserve.models.weights import load_hf_config
from aserve.scheduler.scheduler import Scheduler
from aserve.tokenizer import Tokenizer, has_tokenizer

logger = logging.getLogger(__name__)


class Runtime:
    def __init__(self, config: ServerConfig) -> None:
        started = time.perf_counter()
        self.config = config
        self.model_dir = resolve_model(config.engine.model_path)
        hf_config, generation_config = load_hf_config(self.model_dir)
        self.model_config = ModelConfig.from_hf(hf_config, generation_config)
        self.tokenizer = (
            Tokenizer(self.model_dir, config.num_tokenizer)
            if has_tokenizer(self.model_dir)
            else None
        )
        self.engine = Engine(config.engine, self.model_config, self.model_dir)
        self.scheduler = Scheduler(self.engine, config.scheduler)
        self.startup_seconds = time.perf_counter() - started
        logger.info("model ready: %s (%s)", self.model_dir, self.engine.describe())

    def close(self) -> None:
        self.scheduler.stop()
        if self.tokenizer is not None:
            self.tokenizer.close()

"""Constrained decoding through xgrammar: compile a request's constraint, then keep a matcher
per request that says which tokens may come next.

xgrammar (the library vLLM and SGLang use) turns JSON schemas, regular expressions and EBNF
grammars into token-level automata for one tokenizer; its compiler keeps compiled grammars
in its own cache, keyed by the grammar's text, so a schema that many requests share is
compiled once. Compiling runs in the tokenizer's thread pool, off the event loop. Each step,
the scheduler asks the running requests' matchers for a bitmask of allowed tokens (32 a
word), the engine sets every other logit to -inf before sampling, and the sampled token is
fed back to the matcher. Requests without a constraint take no part in any of it.

xgrammar is imported only when the first constraint arrives (its import takes seconds).
The bitmasks themselves are constrained/masks.py's.
"""

from __future__ import annotations

import json
import re
from typing import Any

from aserve.sampling_params import SamplingParams
from aserve.tokenizer import Tokenizer


class GrammarError(ValueError):
    """A constraint that cannot be compiled: the message says why, for a 400 reply."""


def _clean(error: Exception) -> str:
    """xgrammar's C++ message without its "[time] file.cc:line:" prefix."""
    text = str(error).strip()
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text).replace(
        "Check failed: (error.empty()) is false: ", ""
    )


class GrammarCompiler:
    """Compiles SamplingParams' constraints for one tokenizer and model vocabulary (which
    can be larger than the tokenizer's: the extra ids are never allowed)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self._compiler: Any = None

    def _xgrammar(self) -> Any:
        if self._compiler is None:
            import xgrammar

            info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer.hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids
            )
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        return self._compiler

    def compile(self, params: SamplingParams) -> Any:
        """The compiled grammar of `params`' constraint (None without one); GrammarError
        names what is wrong with a bad schema, pattern or grammar."""
        constraint = params.constraint
        if constraint is None:
            return None
        kind, text = constraint
        compiler = self._xgrammar()
        try:
            if kind == "json_schema":
                return compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                alternatives = " | ".join(json.dumps(c) for c in json.loads(text))
                return compiler.compile_grammar(f"root ::= {alternatives}")
            if kind == "structural_tag":
                return compiler.compile_structural_tag(text)
            return compiler.compile_grammar(text)
        except (RuntimeError, ValueError) as error:
            raise GrammarError(f"invalid {kind}: {_clean(error)}") from None

    async def compile_async(self, params: SamplingParams) -> Any:
        return await self.tokenizer.run_in_pool(self.compile, params)


def new_matcher(grammar: Any) -> Any:
    """A fresh matcher at the start of `grammar` (a compiled one: xgrammar is loaded)."""
    import xgrammar

    return xgrammar.GrammarMatcher(grammar)

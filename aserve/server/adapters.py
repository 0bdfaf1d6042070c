"""LoRA adapters loaded and unloaded at run time (vLLM's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter`, SGLang's paths without `/v1`), on a server started with
`--enable-lora`: the folder is read on a worker thread, then copied into a free slot of
the model's adapters (aserve/lora/) between steps, on the loop. An adapter that requests
still run on (or wait for) is not unloaded; a request whose adapter went between its parsing
and its submission ends with a 400.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from aserve.config import ConfigError
from aserve.lora.adapter import read_adapter
from aserve.lora.layers import AdapterSlots
from aserve.runtime import Runtime
from aserve.server import openai, protocol
from aserve.server.http import json_response
from aserve.server.openai import APIError
from aserve.server.state import ServerState

logger = logging.getLogger(__name__)


def adapter_folders(runtime: Runtime) -> dict[str, str]:
    """The adapters loaded, by name: their folders."""
    slots = runtime.engine.adapters
    return {} if slots is None else dict(slots.paths)


class AdapterRoutes:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def add_to(self, app: web.Application) -> None:
        for prefix in ("/v1", ""):
            app.router.add_post(f"{prefix}/load_lora_adapter", self.load)
            app.router.add_post(f"{prefix}/unload_lora_adapter", self.unload)

    def _slots(self, runtime: Runtime) -> AdapterSlots:
        slots = runtime.engine.adapters
        if slots is None or not runtime.engine.config.enable_lora:
            raise APIError("start the server with --enable-lora to load adapters at run time")
        if runtime.engine.tp.size > 1:
            raise APIError("adapters are loaded at run time with --tp 1 only")
        return slots

    async def load(self, request: web.Request) -> web.Response:
        runtime, limits = self.state.ready()
        body = openai.parse_body(protocol.LoadLoraAdapter, await limits.read_body(request))
        slots = self._slots(runtime)
        name = body.lora_name
        if name == self.state.model_name or name in slots.names:
            taken = "the model's own name" if name == self.state.model_name else "loaded already"
            raise APIError(f"a LoRA adapter named {name!r}: {taken}", param="lora_name")
        loop = asyncio.get_running_loop()
        try:
            adapter = await loop.run_in_executor(None, read_adapter, name, body.lora_path)
            slots.place(adapter)
        except ConfigError as error:
            raise APIError(str(error), param="lora_path") from None
        logger.info("LoRA adapter %s loaded: rank %d, from %s", name, adapter.rank, adapter.path)
        return json_response({"success": True, "loaded_adapters": adapter_folders(runtime)})

    async def unload(self, request: web.Request) -> web.Response:
        runtime, limits = self.state.ready()
        body = openai.parse_body(protocol.UnloadLoraAdapter, await limits.read_body(request))
        slots = self._slots(runtime)
        name = body.lora_name
        if name not in slots.names:
            raise APIError(
                f"no LoRA adapter {name!r} is loaded", 404, param="lora_name", code="not_found"
            )
        held = runtime.scheduler.holds_adapter(slots.names[name])
        if held:
            raise APIError(f"{held} requests still run on LoRA adapter {name!r}", param="lora_name")
        slots.remove(name)
        logger.info("LoRA adapter %s unloaded", name)
        return json_response({"success": True, "loaded_adapters": adapter_folders(runtime)})

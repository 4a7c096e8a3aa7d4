"""vLLM's runtime LoRA endpoints: POST /v1/load_lora_adapter {lora_name, lora_path} and POST
/v1/unload_lora_adapter {lora_name}, answered as vLLM answers them (a plain-text success line, a
400 naming the field otherwise). The folder is read off the event loop and off the engine's
step loop (in the tokenizer pool); only registering the read adapter runs on the engine thread.
A request then names the adapter as its `model` (docs/lora.md)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from engines.builtin.lora.adapter import LoRAError
from engines.builtin.lora.manager import LoRAManager
from serving.generation import ServingEngine
from serving.protocol import APIError, read_request


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class LoadLoRAAdapterRequest(_Strict):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Strict):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's, accepted and unused (names are the keys here)


def add_lora_routes(app: FastAPI, serving: ServingEngine) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = await read_request(request, LoadLoRAAdapterRequest)
        lora = _manager(serving)
        if not body.lora_name or body.lora_name == serving.model_name:
            raise APIError(
                f"lora_name: {body.lora_name!r} is invalid; allowed: a name other than the "
                f"base model's ({serving.model_name})",
                "lora_name",
                "invalid_value",
            )
        if body.lora_name in lora.names:
            raise APIError(
                f"lora_name: the adapter {body.lora_name!r} is already loaded",
                "lora_name",
                "invalid_value",
            )
        try:
            adapter = await serving.in_tokenizer_pool(lora.read, body.lora_name, body.lora_path)
        except LoRAError as exc:
            raise APIError(str(exc), "lora_path", "invalid_value") from None
        await _on_engine(serving, lambda engine: lora.add(adapter))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = await read_request(request, UnloadLoRAAdapterRequest)
        _manager(serving)
        if serving.adapter_holds.get(body.lora_name):  # admitted, maybe not yet in the engine
            raise APIError(
                f"lora_name: {body.lora_name!r} is in use by running or waiting requests",
                "lora_name",
                "invalid_value",
            )
        await _on_engine(serving, lambda engine: engine.remove_lora(body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _manager(serving: ServingEngine) -> LoRAManager:
    lora = serving.engine.lora
    if lora is None:
        raise APIError(
            "this server serves no LoRA adapters; start it with engine.enable_lora=true",
            "lora_name",
            "invalid_value",
        )
    return lora


async def _on_engine(serving: ServingEngine, command: Any) -> None:
    """Run `command(engine)` on the engine thread; its ValueError is a 400 naming lora_name."""
    serving.check_serving()
    try:
        await asyncio.wrap_future(serving.engine_thread.call(command))
    except ValueError as exc:
        message = str(exc)
        if message.startswith("lora:"):
            message = "lora_name:" + message.removeprefix("lora:")
        raise APIError(message, "lora_name", "invalid_value") from None

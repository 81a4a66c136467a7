"""LoRA adapters loaded and unloaded while the server runs (vLLM's routes and bodies):

    POST /v1/load_lora_adapter    {"lora_name": ..., "lora_path": ...}   a PEFT adapter folder
    POST /v1/unload_lora_adapter  {"lora_name": ...}

A loaded adapter is served under its name: a request's `model` picks it, and /v1/models lists
it. An adapter this model cannot take is refused (400) and nothing changes; unloading one that
unfinished requests use is refused (409) until they end.

Both routes are off (403) unless the operator names folders adapters may be read from
(`serve --lora-dir DIR`, ServerConfig.lora_dirs, as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING):
a path outside them, or one that cannot be resolved, is refused before anything under it is
read, with one message whether it exists or not."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Annotated

from fastapi import FastAPI, Request
from pydantic import Field

from ...errors import InputError
from ..errors import AdapterInUse, UnknownAdapter
from . import errors
from .errors import APIError
from .protocol import Strict
from .server import Server

Name = Annotated[str, Field(min_length=1, max_length=256)]


class LoadLoRARequest(Strict):
    lora_name: Name
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]


class UnloadLoRARequest(Strict):
    lora_name: Name


def adapter_models(server: Server) -> list[dict]:
    """/v1/models' entries for the loaded adapters (their base as `parent`)."""
    return [{"id": name, "object": "model", "created": 0, "owned_by": "glassformer",
             "root": adapter.path, "parent": server.config.model_name}
            for name, adapter in server.engine.adapters.loaded.items()]


def check_enabled(server: Server) -> None:
    if not server.config.lora_dirs:
        raise APIError(403, "loading and unloading LoRA adapters at run time is off on this server "
                       "(serve --lora-dir DIR turns it on for adapters under DIR)", code="runtime_lora_off")


def allowed_path(server: Server, path: str) -> str:
    """`path` resolved, if it lies under one of the server's lora_dirs; else 403, the same
    whether the path exists or not."""
    refused = APIError(403, "lora_path: not under a folder this server loads adapters from "
                       "(--lora-dir)", "lora_path", "lora_path_not_allowed")

    def inside(candidate: str) -> bool:
        return any(os.path.commonpath([candidate, folder]) == folder for folder in roots)

    roots = [os.path.realpath(folder) for folder in server.config.lora_dirs]
    if "\0" in path or not inside(os.path.normpath(os.path.abspath(path))):
        raise refused  # nothing read: no hint whether the path exists
    try:
        real = os.path.realpath(path)  # links followed: one may point outside
    except OSError:
        raise refused from None
    if not inside(real):
        raise refused
    return real


def install(app: FastAPI, server: Server, authorize: Callable[[Request], None]) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> dict:
        authorize(request)
        check_enabled(server)
        body = await server.parse(request, LoadLoRARequest)
        path = allowed_path(server, body.lora_path)
        if body.lora_name == server.config.model_name:
            raise APIError(400, f"lora_name: {body.lora_name!r} is the base model's name", "lora_name",
                           "invalid_value")
        try:  # the files are read off the event loop
            await asyncio.to_thread(server.engine.load_adapter, body.lora_name, path)
        except InputError as error:  # anything but the name is about the adapter's files
            field = error.field if error.field in LoadLoRARequest.model_fields else "lora_path"
            raise errors.from_input(error, {error.field: field}) from None
        except OSError:  # unreadable under an allowed folder: no more detail than that
            raise APIError(400, "lora_path: no adapter could be read there", "lora_path",
                           "invalid_value") from None
        return {"object": "lora_adapter", "id": body.lora_name, "status": "loaded"}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> dict:
        authorize(request)
        check_enabled(server)
        body = await server.parse(request, UnloadLoRARequest)
        try:
            server.engine.unload_adapter(body.lora_name)
        except AdapterInUse as error:
            raise APIError(409, str(error), "lora_name", "adapter_in_use") from None
        except UnknownAdapter as error:
            raise APIError(404, str(error), "lora_name", "adapter_not_found") from None
        return {"object": "lora_adapter", "id": body.lora_name, "status": "unloaded"}

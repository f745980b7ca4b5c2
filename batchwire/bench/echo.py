"""A bare FastAPI echo endpoint: the floor batchwire's CPU per request is measured against.

``batchwire bench --start echo`` starts it. It answers ``POST /v1/inference`` with the input reversed
(what the sim backend answers, so ``--check`` holds) and ``GET /readyz`` with 200, served by uvicorn
on uvloop and httptools as the gateway is, with a pydantic body as the gateway's: what is left in a
batchwire request's CPU beyond this is batchwire's own work.

``--start echo-asgi`` (``--asgi``) serves the same answers from a plain ASGI callable, without FastAPI:
the HTTP server's own share of that floor.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send


class Echo(BaseModel):
    input: str


def app() -> FastAPI:
    echo = FastAPI()

    @echo.post("/v1/inference")
    async def inference(body: Echo) -> dict[str, str]:
        return {"output": body.input[::-1]}

    @echo.get("/readyz")
    async def ready() -> dict[str, str]:
        return {"status": "ready"}

    return echo


async def asgi_app(scope: Scope, receive: Receive, send: Send) -> None:
    """The echo as a plain ASGI callable (no routing, no validation: the server alone)."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    doc: dict[str, Any] = {"status": "ready"}
    if scope["method"] == "POST":
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        doc = {"output": json.loads(body)["input"][::-1]}
    answer = json.dumps(doc).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--asgi", action="store_true", help="serve a plain ASGI callable instead of FastAPI")
    args = parser.parse_args()
    uvicorn.run(
        asgi_app if args.asgi else app(),
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
        server_header=False,
        date_header=False,
    )


if __name__ == "__main__":
    main()

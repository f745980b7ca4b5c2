"""A bare FastAPI echo endpoint: the floor batchwire's CPU per request is measured against.

``batchwire bench --start echo`` starts it. It answers ``POST /v1/inference`` with the input reversed
(what the sim backend answers, so ``--check`` holds) and ``GET /readyz`` with 200, served by uvicorn
on uvloop and httptools as the gateway is, with a pydantic body as the gateway's: what is left in a
batchwire request's CPU beyond this is batchwire's own work.
"""

from __future__ import annotations

import argparse

import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(
        app(),
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

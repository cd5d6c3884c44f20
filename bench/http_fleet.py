"""Lightweight HTTP responders: many aiohttp servers in one process, each answering the
control endpoints the way an inference server does (`POST /pause?mode=`, `POST /resume`).

    python -m rlfabric.bench.http_fleet --ports 8100,8101,...
"""

from __future__ import annotations

import argparse

import anyio
from aiohttp import web


async def serve(ports: list[int]) -> None:
    paused = {"mode": ""}

    async def pause(request: web.Request) -> web.Response:
        paused["mode"] = request.query.get("mode", "wait")
        return web.json_response({"ok": True, "paused": True})

    async def resume(request: web.Request) -> web.Response:
        paused["mode"] = ""
        return web.json_response({"ok": True, "paused": False})

    app = web.Application()
    app.router.add_post("/pause", pause)
    app.router.add_post("/resume", resume)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for port in ports:
        await web.TCPSite(runner, "127.0.0.1", port).start()
    print(f"http fleet ready: {len(ports)} servers", flush=True)
    try:
        await anyio.sleep_forever()
    finally:
        await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ports", required=True)
    a = p.parse_args()
    try:
        anyio.run(serve, [int(x) for x in a.ports.split(",")])
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

"""`moebius serve`: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn; `pip install moebius[serve]`).

protocol.py (request models, errors), engine_loop.py (the thread that owns the EngineCore), metrics.py (Prometheus),
serving.py (completions and chat: parameters, answers, streams), app.py (routes, middleware), server.py (CLI, run,
graceful shutdown). Nothing here is imported by the engine.
"""

"""The coordinator's OpenAI-compatible HTTP API (FastAPI on uvicorn), served beside its gRPC API.

    openai_request   OpenAI request bodies -> GenerateRequest (400 naming an unsupported parameter)
    openai_response  GenerationSummary / chunks -> OpenAI bodies, usage, vLLM's spec-decode metrics
    session_feed     one generation run in its own task, cancelled when its client goes away
    http_app         the FastAPI routes, bearer tokens, status codes
    http_server      uvicorn in the coordinator's event loop, with the coordinator's TLS
"""

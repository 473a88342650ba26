"""The OpenAI-compatible HTTP gateway: FastAPI in front of the inference workers' gRPC API."""

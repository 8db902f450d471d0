# The project's image: the backend and the MCP server (compose.yaml runs both from it).
# PyTorch comes from the index named by TORCH_INDEX (CUDA by default; use .../whl/cpu for a CPU image).
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ENV PYTHONUNBUFFERED=1 SCRIPTORIUM_HOME=/data
WORKDIR /app
# A C compiler: Triton builds its launchers with it on CUDA, and the CPU kernels are compiled at first use.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir torch --index-url ${TORCH_INDEX}
COPY pyproject.toml README.md ./
COPY backend backend
COPY orchestrator orchestrator
COPY mcp_server mcp_server
COPY ops ops
RUN pip install --no-cache-dir . && python -m backend models pull smollm2
VOLUME /data
EXPOSE 8000 8765
CMD ["python", "-m", "backend", "serve", "--host", "0.0.0.0", "--port", "8000"]

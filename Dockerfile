# dp-proxy in front of an existing Postgres: docker run -v my.toml:/etc/dp-proxy/config.toml ...
FROM python:3.11-slim

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY server ./server
COPY dp_core ./dp_core
COPY config ./config
RUN pip install --no-cache-dir . \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin dpproxy \
 && mkdir -p /etc/dp-proxy && cp config/example.toml /etc/dp-proxy/config.toml

USER dpproxy
EXPOSE 6432
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import socket; socket.create_connection(('127.0.0.1', 6432), 2).close()"]
ENTRYPOINT ["dp-proxy"]
CMD ["serve", "--config", "/etc/dp-proxy/config.toml"]

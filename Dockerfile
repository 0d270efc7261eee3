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
# metrics and /healthz on 9187 inside the container; set DPPROXY_METRICS__HOST=0.0.0.0 to scrape
ENV DPPROXY_METRICS__PORT=9187
EXPOSE 6432 9187
# healthy = /healthz answers 200 = the proxy runs and its backend answers
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD ["dp-proxy", "healthcheck", "--config", "/etc/dp-proxy/config.toml"]
ENTRYPOINT ["dp-proxy"]
CMD ["serve", "--config", "/etc/dp-proxy/config.toml"]

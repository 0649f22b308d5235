# The image compose.yaml runs the example shop with (the API and every service). Spark is not included (see spark_bridge/).
FROM python:3.12-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY broker broker
COPY framework framework
COPY example_services example_services
COPY spark_bridge spark_bridge
RUN pip install --no-cache-dir ".[sql,web]"
USER nobody
ENTRYPOINT []
CMD ["framework", "--help"]

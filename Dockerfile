# The image compose.yaml runs the example services with. Spark is not included (see spark_bridge/).
FROM python:3.12-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY broker broker
COPY framework framework
COPY example_services example_services
COPY spark_bridge spark_bridge
RUN pip install --no-cache-dir ".[sql]"
USER nobody
ENTRYPOINT []
CMD ["framework", "--help"]

# syntax=docker/dockerfile:1
#
# dlx-proxy image: a static-ish Rust binary on distroless (glibc, CA
# certificates, no shell), running as the non-root user 65532.
#
#   docker build -t dlx-proxy:0.1.0 .
#   docker run --rm -p 5672:5672 -p 15692:15692 -v dlx-proxy-data:/var/lib/dlx-proxy dlx-proxy:0.1.0
#
# The config is read from /etc/dlx-proxy/config.toml; mount a directory over
# /etc/dlx-proxy (not a single file: the live reload watches the directory).

ARG RUST_VERSION=1
FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
# Dependencies and sources; .dockerignore keeps target/ and .git/ out.
COPY . .
# Cache mounts keep the registry and build artifacts between builds; the
# binary is copied out of the cached target directory.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin dlx-proxy \
 && install -D -m 0755 target/release/dlx-proxy /out/dlx-proxy \
 && install -d -m 0750 /out/data

FROM gcr.io/distroless/cc-debian12:nonroot
LABEL org.opencontainers.image.title="dlx-proxy" \
      org.opencontainers.image.description="AMQP 0-9-1 dead-letter proxy and embedded broker" \
      org.opencontainers.image.version="0.1.0"
COPY --from=build /out/dlx-proxy /usr/local/bin/dlx-proxy
COPY --chown=0:0 deploy/docker/config.toml /etc/dlx-proxy/config.toml
# storage.dir of that config: durable queues and persistent messages. Mount a
# volume here to keep them beyond the container (the Helm chart does).
COPY --from=build --chown=65532:65532 /out/data /var/lib/dlx-proxy
VOLUME /var/lib/dlx-proxy
# distroless "nonroot" is uid/gid 65532; set numerically so Kubernetes'
# runAsNonRoot check can verify it.
USER 65532:65532
# 5672 AMQP, 5671 AMQP over TLS, 15692 admin HTTP (/metrics /healthz /readyz).
EXPOSE 5672 5671 15692
ENTRYPOINT ["dlx-proxy", "run", "--config", "/etc/dlx-proxy/config.toml"]

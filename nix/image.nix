# The OCI image: the patched vLLM environment and every app of the flake, `serve-flash-next` as
# the entry point, for the NVIDIA container runtime (`docker run --gpus all`, docs/nix.md).
#
# The runtime mounts the host driver's libraries into the container at start (into
# /usr/lib64 or /usr/lib/<arch>-linux-gnu): nothing of the driver is in the image. The apps
# find them there as they do on DGX OS (magpie/nix/nvidia-driver-libs.sh searches both folders).
# NVIDIA_VISIBLE_DEVICES / NVIDIA_DRIVER_CAPABILITIES are what the runtime reads to decide which
# GPUs and which driver parts (compute: libcuda; utility: nvidia-smi, NVML) to inject; it puts
# nvidia-smi in /usr/bin, hence /usr/bin on PATH.
#
# The image has no /etc/passwd: the server runs as whatever uid the runtime gives it, and
# `launch plan` records `uid N` where no passwd entry names it (magpie/serving/launch.py
# user_name). The CA bundle (cacert, SSL_CERT_FILE) lets a model given as a hub id be fetched.
{
  lib,
  dockerTools,
  bash,
  coreutils,
  cacert,
  scope,
  port ? 8100,
}:
let
  serve = scope.apps.serve-flash-next;
in
dockerTools.buildLayeredImage {
  name = "magpie-vllm";
  tag = scope.vllmRelease;
  # Each app brings the environment and its tools by reference. buildLayeredImage gives each
  # store path its own layer (the most shared first, up to maxLayers): the wheel closure (torch,
  # the CUDA libraries and every other pinned wheel, ~7 GB) is one store path and so one layer,
  # not one per library; a new patch rebuilds the patched vLLM, the environment and the apps,
  # whose layers are small, and leaves the closure's layer as it is.
  contents = [
    bash
    coreutils
    cacert
  ]
  ++ builtins.attrValues scope.apps;
  # No root needed: the layer's own tree (the folders the volumes and the server write to).
  extraCommands = ''
    mkdir -p model keep logs cache
    mkdir -m 1777 tmp
  '';
  config = {
    Entrypoint = [ (lib.getExe serve) ];
    # serve.sh's LOG: the log, LOG.launch.json (the run manifest) and LOG.pid beside it.
    Cmd = [ "/logs/serve.log" ];
    Env = [
      "PATH=/bin:/usr/bin"
      "SSL_CERT_FILE=${cacert}/etc/ssl/certs/ca-bundle.crt"
      "MODEL=/model"
      "HOST=0.0.0.0"
      "PORT=${toString port}"
      "NVIDIA_VISIBLE_DEVICES=all"
      "NVIDIA_DRIVER_CAPABILITIES=compute,utility"
      # The driver-library links and FlashInfer's JIT cache: a volume, kept across runs.
      "XDG_CACHE_HOME=/cache"
      "TMPDIR=/tmp"
    ];
    ExposedPorts."${toString port}/tcp" = { };
    Volumes = {
      "/model" = { };
      "/keep" = { };
      "/logs" = { };
      "/cache" = { };
    };
    WorkingDir = "/tmp";
    Labels = {
      "org.opencontainers.image.title" = "magpie-vllm";
      "org.opencontainers.image.description" =
        "vLLM ${scope.vllmRelease} with the magpie-vllm-plugins patch series";
    };
  };
}

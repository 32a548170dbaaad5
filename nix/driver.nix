# Host NVIDIA driver discovery for apps run outside NixOS (DGX OS keeps libcuda.so.1 in
# /usr/lib/aarch64-linux-gnu, which Nix-built programs never search).
{
  writeShellApplication,
  coreutils,
  findutils,
  source,
}:
writeShellApplication {
  name = "nvidia-driver-libs";
  runtimeInputs = [
    coreutils
    findutils
  ];
  text = builtins.readFile ../magpie/nix/nvidia-driver-libs.sh;
  passthru.script = "${source.tools}/magpie/nix/nvidia-driver-libs.sh";
}

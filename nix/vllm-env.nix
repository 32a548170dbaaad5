# The Python environment users run: the wheel closure, the patched vLLM and, when asked for
# (withFlashinferAot), FlashInfer's ahead-of-time kernels. `bin/python` and `bin/vllm` see all
# of them.
{
  lib,
  python,
  magpieLib,
  wheelClosure,
  vllm,
  flashinferJitCache,
  withFlashinferAot,
  cudaCapabilities,
}:
let
  env =
    (python.withPackages (
      _:
      [
        wheelClosure
        vllm
      ]
      ++ lib.optional (withFlashinferAot && cudaCapabilities != [ ]) flashinferJitCache
    )).overrideAttrs
      (old: {
        name = "vllm-${vllm.version}-magpie-env";
        # The wrapper's passthru names the environment before this override (another store
        # path, once the name changes): point it at this one.
        passthru = (old.passthru or { }) // {
          interpreter = "${env}/bin/${python.executable}";
          env = env;
        };
        meta = (old.meta or { }) // {
          description = "Python ${python.pythonVersion} with vLLM ${vllm.version} (patched), for CUDA ${lib.concatStringsSep ", " cudaCapabilities}";
          mainProgram = "vllm";
          platforms = magpieLib.systems;
        };
      });
in
env

# A CUDA_HOME for FlashInfer's compiler (ahead of time and at run time), made from the CUDA
# tree the pinned NVIDIA wheels install (nvcc, headers, libcudart of the same closure as torch),
# with the two things wheels lack: the lib64 layout FlashInfer links from, and a libcuda stub.
{
  runCommandCC,
  wheelClosure,
}:
# runCommandCC: the libcuda stub below is linked with `cc`.
runCommandCC "cuda-home-from-wheels-${wheelClosure.version}"
  {
    passthru.nvcc = "bin/nvcc";
  }
  ''
    tree=${wheelClosure}/${wheelClosure.cudaTree}
    if [ ! -x "$tree/bin/nvcc" ]; then
      echo "no nvcc in $tree: the wheel closure's CUDA layout changed" >&2
      exit 1
    fi
    mkdir -p "$out/bin" "$out/lib64/stubs"
    for dir in include nvvm lib; do
      ln -s "$tree/$dir" "$out/$dir"
    done
    # nvcc finds its profile, and through it lib64 (-lcudadevrt -lcudart_static), next to its
    # resolved own path: a copy makes that path this folder (a link would point into the wheel
    # tree, which has lib/ only; measured: "cannot find -lcudadevrt").
    for file in "$tree"/bin/*; do
      ln -s "$file" "$out/bin/"
    done
    rm "$out/bin/nvcc" "$out/bin/nvcc.profile"
    cp "$tree/bin/nvcc" "$tree/bin/nvcc.profile" "$out/bin/"
    for file in "$tree"/lib/*; do
      ln -s "$file" "$out/lib64/"
    done
    # FlashInfer links with -L$CUDA_HOME/lib64 -lcudart -lcuda.
    ln -s libcudart.so.13 "$out/lib64/libcudart.so"
    # libcuda belongs to the host driver. Linking a shared object against an empty library
    # with its soname records the dependency and leaves the symbols to the real driver at
    # load time, as NVIDIA's own stubs do.
    : > empty.c
    cc -shared -Wl,-soname,libcuda.so.1 -o "$out/lib64/stubs/libcuda.so" empty.c
  ''

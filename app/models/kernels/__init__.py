"""C kernels built with the machine's compiler at first use, and their ctypes loaders."""

"""The engine's own C++ kernels (the .cpp / .h beside this file) and their Python side: the
build and the per-kernel switches (native), the panel-packed linear layers (panels) and the
measured choice between kernels (plan). Every kernel has a torch fallback for shapes it does
not serve."""

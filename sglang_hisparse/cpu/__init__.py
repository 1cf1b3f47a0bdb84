"""Running HiSparse without a GPU: the torch-native DSA path and the CPU stand-ins."""

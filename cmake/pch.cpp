// The source of blockswap_torch_pch (CMakeLists.txt, Note [precompiled torch headers]): the
// target exists to hold the precompiled torch headers that other targets reuse.

// A shared library that is not a loom plugin: it exports a function but no descriptor.
extern "C" __attribute__((visibility("default"))) int not_a_loom_plugin() { return 42; }

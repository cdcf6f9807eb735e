#include "cli.hpp"

int main(int argc, char** argv) { return loom::core::run_cli(argc, argv); }

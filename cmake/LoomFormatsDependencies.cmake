# What the formats library (formats/) needs, found for loom's build and for the library's own:
# nlohmann-json; ICU (Jinja's str methods: case mapping, character classes on Unicode's tables;
# the hf-json tokenizer uses it too); Parquet's page codecs: gzip (zlib), zstd and snappy;
# flatbuffers (Arrow's metadata, verified).
find_package(nlohmann_json REQUIRED)
find_package(ICU REQUIRED COMPONENTS uc)
find_package(ZLIB REQUIRED)
find_path(LOOM_ZSTD_INCLUDE_DIR zstd.h REQUIRED)
find_library(LOOM_ZSTD_LIBRARY NAMES zstd REQUIRED)
find_path(LOOM_SNAPPY_INCLUDE_DIR snappy.h REQUIRED)
find_library(LOOM_SNAPPY_LIBRARY NAMES snappy REQUIRED)
# Arrow IPC's metadata: flatc compiles formats/src/arrow.fbs; its verifier is header-only.
find_program(LOOM_FLATC flatc REQUIRED)
find_path(LOOM_FLATBUFFERS_INCLUDE_DIR flatbuffers/flatbuffers.h REQUIRED)

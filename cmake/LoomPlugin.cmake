# loom_add_torch_pch(<target> [WITHOUT <sources>...]): precompiles the LibTorch headers loom's code
# uses most, which otherwise cost 10-20 s in every translation unit. Sources that include no
# LibTorch header are listed after WITHOUT: loading the 400 MB header costs them more (~4 s) than
# parsing what they include.
function(loom_add_torch_pch target)
  cmake_parse_arguments(ARG "" "" "WITHOUT" ${ARGN})
  target_precompile_headers(${target} PRIVATE <ATen/ATen.h> <torch/nn/module.h>)
  if(ARG_WITHOUT)
    set_source_files_properties(${ARG_WITHOUT} TARGET_DIRECTORY ${target} PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
  endif()
endfunction()

# loom_add_plugin(<target> SOURCES <files...> [KIT] [OUTPUT_DIR <dir>] [NO_INSTALL] [TORCH_PCH])
# Builds one plugin library: hidden visibility (only the descriptor alias is exported), no "lib"
# prefix, linked to loom::sdk, and to loom::kit with KIT (the generic decoder and its blocks).
# OUTPUT_DIR: where the built library goes; NO_INSTALL: not installed with loom (out-of-tree and
# test plugins); TORCH_PCH: LibTorch's headers precompiled (pays off from about 3 sources).
# Used by loom's own plugins and by out-of-tree plugins alike.
function(loom_add_plugin target)
  cmake_parse_arguments(ARG "NO_INSTALL;TORCH_PCH;KIT" "OUTPUT_DIR" "SOURCES" ${ARGN})
  add_library(${target} MODULE ${ARG_SOURCES})
  target_link_libraries(${target} PRIVATE loom::sdk)
  if(ARG_KIT)
    target_link_libraries(${target} PRIVATE loom::kit)
  endif()
  set_target_properties(${target} PROPERTIES
    PREFIX ""
    CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
  if(ARG_TORCH_PCH)
    loom_add_torch_pch(${target})
  endif()
  if(ARG_OUTPUT_DIR)
    set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${ARG_OUTPUT_DIR})
  elseif(DEFINED LOOM_PLUGIN_OUTPUT_DIR)
    set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${LOOM_PLUGIN_OUTPUT_DIR})
  endif()
  if(NOT ARG_NO_INSTALL AND DEFINED LOOM_INSTALL_PLUGIN_DIR)
    # Installed in <libdir>/loom/plugins: the kit is two folders up (the host loads the SDK itself).
    set_target_properties(${target} PROPERTIES INSTALL_RPATH "$ORIGIN/../..")
    install(TARGETS ${target} LIBRARY DESTINATION ${LOOM_INSTALL_PLUGIN_DIR})
  endif()
endfunction()

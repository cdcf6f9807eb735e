#pragma once
#include <stdexcept>
#include <string>

#include "loom/export.hpp"

namespace loom {

// Something the user can fix (bad pipeline, bad file, impossible request). The host prints
// what() as one line and exits 2. Plugins throw it for bad options or bad input files.
class LOOM_API UserError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace loom

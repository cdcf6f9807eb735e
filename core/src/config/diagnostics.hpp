#pragma once
#include <string>
#include <vector>

#include "loom/error.hpp"

namespace loom::core {

// Where a problem is: a pipeline file position, a command-line override, or a file as a whole.
struct Location {
  std::string file;  // path as the user gave it, or "--set train.lr"
  int line = 0;      // 0: the file as a whole
  int column = 0;
  std::string str() const;  // "file:line:col", "file"
};

struct Diagnostic {
  Location where;
  std::string message;
  std::string str() const;  // "file:line:col: message"
};

// All the problems found in one pass: the user fixes them all at once, not one per run.
class Diagnostics {
 public:
  void add(Location where, std::string message);
  bool empty() const { return items_.empty(); }
  std::size_t size() const { return items_.size(); }
  const std::vector<Diagnostic>& items() const { return items_; }
  // Throws PipelineError carrying every diagnostic, sorted by file position, if there are any.
  void throw_if_any() const;

 private:
  std::vector<Diagnostic> items_;
};

// A UserError whose what() is every diagnostic, one per line.
class PipelineError : public UserError {
 public:
  explicit PipelineError(std::vector<Diagnostic> diagnostics);
  const std::vector<Diagnostic>& diagnostics() const { return diagnostics_; }

 private:
  std::vector<Diagnostic> diagnostics_;
};

// Closest candidate within a small edit distance, for "did you mean" hints; empty when none is close.
std::string closest_match(const std::string& word, const std::vector<std::string>& candidates);
// ", did you mean 'x'?" or "".
std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace loom::core

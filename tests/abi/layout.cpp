// A stand-in for the public headers (tests/abi/refuses_changes.sh builds it several ways): a kit
// struct, an SDK struct and, by the defines, each changed as a release might change it.
#include <string>
#include <vector>

#define API __attribute__((visibility("default")))

namespace loom {
struct API Batch {
  std::int64_t rows = 0;
#ifdef SDK_GROWN
  std::int64_t skipped = 0;
#endif
  std::vector<std::int64_t> ids;
};
// A plugin interface: every plugin's table of virtuals is laid out by the headers it built with.
class API Collator {
 public:
  virtual ~Collator() = default;
  virtual int collate(int rows) { return rows; }
#ifdef SDK_VIRTUAL
  virtual int split(int rows) { return rows; }  // a virtual added within the major
#endif
};
}  // namespace loom

namespace loom::kit {
struct API DecoderConfig {
  int layers = 1;
  double scale = 1.0;
#ifdef KIT_GROWN
  int experts = 0;  // as DecoderConfig::moe grew inside kit 3.4
#endif
  std::vector<std::string> names;
};
#ifdef KIT_ADDED
struct API RouterSettings {
  int top_k = 2;
};
#endif
}  // namespace loom::kit

extern "C" API int loom_abi_probe() { return 0; }
extern "C" API void loom_abi_reach_loom_Collator(const loom::Collator*) {}

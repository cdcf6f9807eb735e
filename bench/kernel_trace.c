// A CUPTI injection library: every kernel, copy and memset a CUDA process runs, with its start and
// end on the GPU's clock, written as tab-separated lines to $LOOM_KERNEL_TRACE when the process
// exits. The driver loads it when CUDA_INJECTION64_PATH names it, so it traces loom and HF's
// Python alike, with CUPTI's activity API (asynchronous buffers, a few percent overhead), which is
// what Nsight Systems records and the GPU machine lacks. bench/profile.sh builds and reads it.
//   KIND start_ns end_ns stream name     (KIND: K kernel, C copy, S memset)
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

static FILE* trace_out;

static void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = (size_t)16 << 20;
  *buffer = (uint8_t*)aligned_alloc(8, *size);
  *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext context, uint32_t stream, uint8_t* buffer, size_t size, size_t valid) {
  (void)context, (void)stream, (void)size;
  CUpti_Activity* record = NULL;
  while (trace_out != NULL && cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_KERNEL || record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      const CUpti_ActivityKernel10* k = (const CUpti_ActivityKernel10*)record;
      fprintf(trace_out, "K\t%llu\t%llu\t%u\t%s\n", (unsigned long long)k->start, (unsigned long long)k->end, k->streamId, k->name);
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const CUpti_ActivityMemcpy6* c = (const CUpti_ActivityMemcpy6*)record;
      fprintf(trace_out, "C\t%llu\t%llu\t%u\tcopy kind %u, %llu bytes\n", (unsigned long long)c->start, (unsigned long long)c->end, c->streamId,
              (unsigned)c->copyKind, (unsigned long long)c->bytes);
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const CUpti_ActivityMemset4* s = (const CUpti_ActivityMemset4*)record;
      fprintf(trace_out, "S\t%llu\t%llu\t%u\tmemset %llu bytes\n", (unsigned long long)s->start, (unsigned long long)s->end, s->streamId,
              (unsigned long long)s->bytes);
    }
  }
  free(buffer);
}

static void flush_trace(void) {
  cuptiActivityFlushAll(1);
  if (trace_out != NULL) fclose(trace_out);
  trace_out = NULL;
}

int InitializeInjection(void) {
  const char* path = getenv("LOOM_KERNEL_TRACE");
  trace_out = fopen(path != NULL ? path : "kernel_trace.tsv", "w");
  if (trace_out == NULL) return 0;
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS || cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET) != CUPTI_SUCCESS) {
    fprintf(stderr, "kernel_trace: CUPTI refused the activity records\n");
    return 0;
  }
  atexit(flush_trace);
  return 1;
}

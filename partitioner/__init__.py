"""fedshard partitioner: ONNX graphs analysed, planned onto devices, cut into segments, checked.

Rooms, each importing only the rooms below it (an import-linter layers contract)::

    cli          ``fedshard split | export | plan`` (light to import: no onnx, no torch)
    models       front doors (torch/Hugging Face to ONNX), decoders, LoRA graph work, GGUF
    cutting      a split end to end: segments, segment cache and files, manifest, calibration,
                 verification
    planning     the exact planner (pure: problem in, plan out), problems from graphs, baselines
    analysis     graph structure, frontier, shapes, units, costs, roofline, runtime memory,
                 decoder state and phases, samples, model file I/O
    errors       the error hierarchy

Below every room: :mod:`protocols` (formats) and :mod:`hostkit`. The partitioner never imports
:mod:`edge_agent`, :mod:`coordinator` or :mod:`devtools`. An own-module import inside a function
is there only to keep onnx or torch off a light import, and says so (``# heavy:``).

- :mod:`partitioner.cli`                          the commands (top room)
- :mod:`partitioner.cli.cli_args`                 shared exit code, argument types, sizes
- :mod:`partitioner.cli.export_cli`               ``fedshard export``
- :mod:`partitioner.cli.plan_cli`                 ``fedshard plan``
- :mod:`partitioner.cli.split_cli`                ``fedshard split`` (and registers export)
- :mod:`partitioner.models`                       packaged models into ONNX, graph work on them
- :mod:`partitioner.models.frontdoor`             front doors: packaged torch/HF model to ONNX
- :mod:`partitioner.models.packaged`              offline Hugging Face, packaged checkpoints
- :mod:`partitioner.models.lora`                  LoRA on exported decoders: weights, layers
- :mod:`partitioner.models.lora_quant`            LoRA over a quantized decoder (QLoRA-style)
- :mod:`partitioner.models.decoders`              decoder front doors (``fedshard.decoder/1``)
- :mod:`partitioner.models.decoders.sources`      which decoders, loaded with torch
- :mod:`partitioner.models.decoders.gemma`        Gemma 3 270M from its package
- :mod:`partitioner.models.decoders.qwen`         Qwen2.5-Coder from chunked GGUF packages
- :mod:`partitioner.models.decoders.tiny`         tiny random decoders for tests
- :mod:`partitioner.models.decoders.cache`        converted checkpoints between runs
- :mod:`partitioner.models.decoders.wrapper`      the exported torch module (explicit KV)
- :mod:`partitioner.models.decoders.export`       ONNX, ``decoder.json``, tokenizer, checks
- :mod:`partitioner.models.decoders.progress`     progress of the slow export steps
- :mod:`partitioner.models.decoders.weights`      the weight precisions (light to import)
- :mod:`partitioner.models.decoders.precision`    fp32, fp16, int8 or int4 weights
- :mod:`partitioner.models.decoders.ort_quantizers`  ONNX Runtime's quantizers as used
- :mod:`partitioner.models.decoders.fp16`         fp16 weights with ONNX Runtime's converter
- :mod:`partitioner.models.decoders.int8rows`     int8 activations quantized per row
- :mod:`partitioner.models.decoders.rowwise`      float products alike for any row count
- :mod:`partitioner.models.decoders.draft_head`   a draft model's lean output head
- :mod:`partitioner.models.decoders.quality`      a precision's cost on real text
- :mod:`partitioner.models.decoders.ort_runner`   greedy generation in one ORT session
- :mod:`partitioner.models.decoders.reference`    transformers' greedy ``generate``
- :mod:`partitioner.models.gguf`                  the GGUF segment builder
- :mod:`partitioner.models.gguf.kernels`          GGUF tensors onto ORT's CPU kernels, per tensor
- :mod:`partitioner.models.gguf.kernels_codes`    quantized blocks as codes, scales and mins
- :mod:`partitioner.models.gguf.kernels_gather`   embedding rows via ``GatherBlockQuantized``
- :mod:`partitioner.models.gguf.kernels_iq`       the grid i-quants as exact 8-bit codes
- :mod:`partitioner.models.gguf.kernels_requant`  a GGUF weight re-quantized to int4/int8
- :mod:`partitioner.models.gguf.reader`           a lean GGUF reader (memory-mapped data)
- :mod:`partitioner.models.gguf.header`           a GGUF header as a typed model, refusals
- :mod:`partitioner.models.gguf.archs`            the five architectures' layers as nodes
- :mod:`partitioner.models.gguf.heap`             the C heap's freed memory given back
- :mod:`partitioner.models.gguf.ends`             the embedding and the output head
- :mod:`partitioner.models.gguf.builder`          one segment per block range, streamed
- :mod:`partitioner.models.gguf.units`            the unit table from the header alone
- :mod:`partitioner.models.gguf.rows`             whether a chain decodes k-token passes as k steps
- :mod:`partitioner.models.gguf.reference`        a numpy forward for tests
- :mod:`partitioner.cutting`                      a planned model cut into segment files
- :mod:`partitioner.cutting.split`                ``fedshard split`` end to end
- :mod:`partitioner.cutting.inputs`               what a split works from: Analysis, SplitOptions
- :mod:`partitioner.cutting.segments`             one self-contained ``ModelProto`` per range
- :mod:`partitioner.cutting.segment_files`        writing segment files (through the cache)
- :mod:`partitioner.cutting.segment_cache`        segment files kept between splits
- :mod:`partitioner.cutting.manifests`            the ``fedshard.manifest/1`` document
- :mod:`partitioner.cutting.calibrate`            optional per-unit timing in ONNX Runtime
- :mod:`partitioner.cutting.verify`               segments chained in ORT against the model
- :mod:`partitioner.planning`                     planning problems in, optimal plans out
- :mod:`partitioner.planning.planner`             the planner: ``plan``, ``evaluate``
- :mod:`partitioner.planning.semantics`           the ``fedshard.problem/1`` cost model, exact
- :mod:`partitioner.planning.tables`              the cost model as numpy tables
- :mod:`partitioner.planning.fleet`               interchangeable devices grouped into classes
- :mod:`partitioner.planning.engine`              the layered dynamic programme
- :mod:`partitioner.planning.reach`               bottleneck feasibility with bit sets
- :mod:`partitioner.planning.backtrack`           the optimal chain from the kept layers
- :mod:`partitioner.planning.synthetic`           synthetic problems at scale
- :mod:`partitioner.planning.problem_from_graph`  graph units and devices to a problem
- :mod:`partitioner.planning.baselines`           baseline splits, scored alike
- :mod:`partitioner.analysis`                     what a graph is and costs, before any plan
- :mod:`partitioner.analysis.graph`               producers, consumers, static nodes
- :mod:`partitioner.analysis.frontier`            execution order, the frontier at every cut
- :mod:`partitioner.analysis.costs`               tensor sizes and node FLOPs
- :mod:`partitioner.analysis.shapes`              concrete shapes, node by node
- :mod:`partitioner.analysis.contrib_shapes`      shapes of ORT contrib operators
- :mod:`partitioner.analysis.units`               planning units between good cuts
- :mod:`partitioner.analysis.roofline`            a unit's FLOPs and bytes read
- :mod:`partitioner.analysis.runtime_memory`      what ORT keeps resident beyond weights
- :mod:`partitioner.analysis.decoding`            per-session state (KV cache)
- :mod:`partitioner.analysis.phases`              a decoder's decode step and prefill
- :mod:`partitioner.analysis.samples`             sample inputs for costing, verification
- :mod:`partitioner.analysis.modelio`             load, save (external data), hash
- :mod:`partitioner.errors`                       the error hierarchy (drawn in its docstring)
"""

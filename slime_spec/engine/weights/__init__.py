"""Weight updates on the embedded engine, behind SGLang's own SchedulerWeightUpdaterManager.

- updater.py: `EngineWeights`: SGLang's manager over our runners (sessions, selectors, versions, replies).
- workers.py: the TP worker / spec worker / model runner faces SGLang's manager calls.
- receive.py: an update received straight into the served parameters, restorable, timed.
- session.py: one session: its selector, how it restores the old weights, its first error; mirror.py: the host copy
  of the served weights a failed session is restored from.
- checker.py: `/weights_checker`: SGLang's WeightChecker over our model, under SGLang's parameter names.
"""

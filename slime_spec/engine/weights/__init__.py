"""Weight updates on the embedded engine, behind SGLang's SchedulerWeightUpdaterManager."""

"""The local engine: one Session in this process, the files one after another, each streamed
a part (row group) and a batch at a time, so memory stays bounded whatever the data's size."""
from __future__ import annotations

from ember.batch.data import to_arrow_table
from ember.batch.job import BatchJob, BatchReport, FileOutput, Progress, plan_files
from ember.batch.predict import ColumnPlan, predict_batch
from ember.runtime.session import load


def run_local(job: BatchJob, progress: bool = False) -> BatchReport:
    """Run `job` in this process (see ember.batch.run_batch)."""
    session = load(job.model, job.backend)
    plan = ColumnPlan.build(session.inputs, session.outputs, job.column_map)
    report = BatchReport()
    sources = plan_files(job, session.inputs, report)
    for source in sources:
        plan.check_columns(source.columns, source.path)
    bar = Progress(sum(s.num_rows for s in sources), progress)
    try:
        for source in sources:
            with FileOutput(source, job, plan, report) as output:
                for part in source.parts(job.batch_size):
                    for first_row, batch in source.batches(part, job.batch_size):
                        output.write(to_arrow_table(predict_batch(session, batch, plan)),
                                     first_row)
                        bar.advance(len(next(iter(batch.values()))))
                output.commit()
    finally:
        bar.close()
    return report

"""The control plane's protocol: typed messages, store keys, the job's key and seals.

Standard library only: the coordinator, agents, workers, shadows and the simulator's tests all
speak it, and none of them needs torch to read a record.
"""

from spotpipe.protocol import keys
from spotpipe.protocol.auth import (Refused, ReplayGuard, Sealed, Sealer, job_key,
                                    new_instance_id, proof, same_secret, token_bytes,
                                    token_from_env, unseal)
from spotpipe.protocol.channel import Channel, Opened, channel_from_env
from spotpipe.protocol.messages import (Abort, AgentArrival, ArrivalsClosed, Assignment,
                                        CheckpointSaved, Close, CoordinatorState, DecisionRecord,
                                        Event, Exit, FinalUpload, from_plain, Heartbeat, JobOver,
                                        JobPosted, JoinAnswer, JoinRequest, Journal, JournalSegment,
                                        Kill, Mark, Message, MessageError, Metrics, Notice, parse,
                                        plain, Prepare, Regroup, Report, ResumeOffer, StageUpload,
                                        Stalled, vouch, vouched)

__all__ = ["Abort", "AgentArrival", "ArrivalsClosed", "Assignment", "Channel", "channel_from_env",
           "CheckpointSaved", "Close", "CoordinatorState", "DecisionRecord", "Event", "Exit",
           "FinalUpload", "from_plain", "Heartbeat", "job_key", "JobOver", "JobPosted",
           "JoinAnswer", "JoinRequest", "Journal", "JournalSegment", "keys", "Kill", "Mark",
           "Message", "MessageError", "Metrics", "new_instance_id", "Notice", "Opened", "parse",
           "plain", "Prepare", "proof", "Refused", "Regroup", "ReplayGuard", "Report",
           "ResumeOffer", "same_secret", "Sealed", "Sealer", "StageUpload", "Stalled",
           "token_bytes", "token_from_env", "unseal", "vouch", "vouched"]

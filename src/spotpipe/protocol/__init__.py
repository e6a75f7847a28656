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
                                        CheckpointSaved, FinalUpload, JobOver, JobPosted, Close, CoordinatorState,
                                        DecisionRecord, Event, Exit, Journal, JournalSegment, Heartbeat, JoinAnswer, JoinRequest, Kill, Mark, Message,
                                        MessageError, Metrics, Notice, Prepare, Regroup, Report, ResumeOffer, StageUpload, Stalled, from_plain, parse,
                                        plain, vouch, vouched)

__all__ = ["Abort", "AgentArrival", "ArrivalsClosed", "Assignment", "FinalUpload", "JobOver",
           "JobPosted", "from_plain", "plain", "vouch", "vouched", "Channel", "channel_from_env", "CheckpointSaved", "Close", "CoordinatorState", "DecisionRecord", "Event", "Exit",
           "Heartbeat", "JoinAnswer", "JoinRequest", "Journal", "JournalSegment", "Kill", "Mark", "Message", "MessageError",
           "Metrics", "Notice", "Opened", "Prepare", "Refused", "Regroup", "Report", "ReplayGuard", "ResumeOffer", "Sealed",
           "Sealer", "StageUpload", "Stalled", "job_key", "keys", "new_instance_id", "parse", "proof", "same_secret",
           "token_bytes", "token_from_env", "unseal"]

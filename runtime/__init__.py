"""Planning and executing IR graphs; sessions."""
from ember.runtime.executor import Plan
from ember.runtime.session import InferenceSession, Session, load

__all__ = ["Plan", "Session", "InferenceSession", "load"]

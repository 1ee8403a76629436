"""recur's own routes: sessions (create, generate, score, fork, versions, transcripts,
import and export), tokens, usage, health, metrics and the playground."""

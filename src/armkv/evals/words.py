"""The word lists RULER's generators draw from, shipped so that generation needs no download.

RULER draws keys (``adjective-noun``) and the common-words list from the ``wonderwords``
package's noun, adjective and verb lists. These are shorter lists of the same kinds of
everyday English words (about 400 adjectives, 560 nouns, 620 verbs), so the tasks keep
their shape: 220k distinct ``adjective-noun`` keys, and about 1,500 distinct words for
common-words extraction before its fallback (see :func:`armkv.evals.ruler.common_words`).
"""

ADJECTIVES = tuple(
    """
able abrasive absent absurd acid acoustic active adorable adventurous afraid aggressive agile alert
alive amazing amused ancient angry anxious aquatic arctic arid aromatic ashamed average awake awful
bad bashful bent better bewildered big billowy bitter black bland blind blue blushing bold bored
boring brave brief bright brisk broad broken brown bumpy busy calm capable careful careless caring
cautious certain charming cheap cheerful chilly chubby clean clever cloudy clumsy coarse cold
colossal common complete complex confused cool cooperative courageous crazy creamy creepy crisp
crooked crowded cruel cuddly curious curly curved cute damp dark dazzling dead deafening deep
defiant delicate delicious delightful dense determined different difficult dirty dizzy dry dull
dusty eager early earthy easy elastic elderly elegant empty enchanted energetic enormous envious
equal even evil excited exotic expensive faded faint fair faithful fancy fantastic fast fat fearless
feeble few fierce filthy fine flaky flat flawless fluffy foolish fragile fragrant frail frantic free
fresh friendly frightened frozen full funny furry fuzzy gentle giant gifted glamorous gleaming
glorious glossy good gorgeous graceful grand grateful greasy great green grieving grumpy guilty
hairy handsome happy hard harsh healthy heavy helpful helpless hidden hilarious hissing hollow
homeless honest hot huge humble hungry hurried icy ideal idle ill immense important impossible
innocent inquisitive itchy jealous jittery jolly joyous juicy kind large late lazy light little
lively lonely long loose loud lovely low lucky magnificent majestic massive mature mean melodic
messy mighty misty modern moist mysterious narrow nasty natural naughty neat nervous new nice noisy
normal nostalgic numerous nutty obedient odd old open orange ordinary organic outrageous pale
perfect plain pleasant plucky polite poor powerful precious pretty prickly proud puny purple quaint
quick quiet quirky rapid rare raspy real red regular rich right ripe robust rotten rough round royal
rude rural rusty sad safe salty scary scattered scrawny selfish shallow sharp shiny short shy silent
silky silly simple skinny sleepy slim slimy slippery slow small smart smooth soft solid sore sour
sparkling spicy splendid spotless square squeaky stale steady steep sticky stormy strange strong
stupid sturdy subtle successful sudden super sweet swift tall tame tangy tart tasty tender tense
terrible thankful thick thin thirsty thoughtful tidy tight tiny tired tough tricky troubled ugly
uneven unusual upset useful vast victorious violent vivid wandering warm wary weak wealthy weary wet
whispering white wicked wide wild windy wise witty wonderful wooden worried wrong yellow young
youthful zany zealous
""".split()
)
NOUNS = tuple(
    """
account acid act actor advice age air airport alarm album alligator anchor angle animal ant apple
apron arch arm army arrow art ash attic aunt baby backpack badge bag bagel bakery balance ball
balloon banana band bank barn basket bat bath battery beach bean bear beard bed bee beetle bell belt
bench berry bicycle bird biscuit blade blanket block blossom boat body bone book boot bottle
boundary bow box boy bracelet brain branch bread brick bridge brother bubble bucket building bulb
bull bus bush butter button cabbage cabin cactus cafe cake calendar camel camera camp canal candle
cannon canoe canvas cap captain car card carpet carrot cart castle cat cattle cave ceiling cell
cellar chain chair chalk channel cheese cherry chess chicken child chimney chin church circle circus
city clam classroom clock cloud clover coach coast coat cobweb coin collar comb comet compass
computer cook copper coral corn cottage cotton cough country cousin cow crab cradle crate crayon
cream creator creek cricket crow crown cup curtain cushion dad daisy dance deer desert desk diamond
dinner dinosaur doctor dog doll dolphin donkey door dragon drawer dream dress drum duck dust eagle
ear earth egg elbow elephant engine envelope eye face factory fairy falcon family farm father
feather fence fern field finger fire fish flag flame flock floor flower flute fly fog font football
forest fork fountain fox frog fruit furnace galaxy garage garden gate gem ghost giraffe girl glass
globe glove goat gold goose grape grass guitar gull hair hall hammer hand harbor harp hat hawk head
heart hedge helmet hen hill hippo hobby hole honey hook horn horse hospital house ice igloo ink
insect island jacket jar jaw jelly jewel judge juice kangaroo kettle key kitchen kite kitten knee
knife knot ladder lake lamb lamp lantern leaf lemon leopard letter library lighthouse lily lion
lizard lobster lock locket machine magnet mailbox map marble market mask meadow medal melon mermaid
metal microscope milk mirror mitten monkey moon moose morning moth motor mountain mouse mouth
mushroom music nail necklace needle nest net night nose notebook nut oak oar ocean octopus office
oil onion orange orchard ostrich otter oven owl ox oyster paddle page pail paint palace pan panda
paper parcel parrot party pasta path peach peacock pear pearl pebble pencil penguin pepper piano
pickle picture pie pig pigeon pillow pilot pin pipe pirate planet plant plate plough pocket poem
pond popcorn pot potato prince puddle pumpkin puppy purse puzzle quilt rabbit raccoon radio rain
rainbow rake rat raven receipt reindeer ribbon rice ring river road robin robot rock rocket roof
room rooster root rope rose ruler sail salad salmon sand sandwich saucer scarf school scissors seal
seashell seed shadow shark sheep shelf shell ship shirt shoe shovel shower silver sink sister skate
skirt sky sled slipper snail snake sock sofa soup spade sparrow spider sponge spoon spring squid
squirrel stable stage stamp star station statue stick stone stool storm stove straw stream street
string submarine sugar suit sun sunflower swan sweater swing sword table tail teacher teapot
telescope tent theater thimble thread throne thumb ticket tiger toad toast toe tomato tooth torch
tortoise towel tower town toy tractor train trampoline tree truck trumpet tulip tunnel turkey turtle
umbrella uncle unicorn valley van vase vest village violin volcano wagon wall walrus wand watch
water wave whale wheel whistle window wing wizard wolf worm yacht yak yard zebra zipper
""".split()
)
VERBS = tuple(
    """
accept add admire admit advise afford agree alert allow amuse announce annoy answer apologize appear
applaud approve argue arrange arrest arrive ask attach attack attempt attend attract avoid bake
balance ban bang bathe battle beam beg behave belong bleach bless blind blink blush boast boil bolt
bomb book bore borrow bounce bow box brake branch breathe bruise brush bubble bump burn bury buzz
calculate call camp care carry carve cause challenge change charge chase cheat check cheer chew
choke chop claim clap clean clear clip close coach coil collect color comb command communicate
compare compete complain complete concentrate concern confess confuse connect consider consist
contain continue copy correct cough count cover crack crash crawl cross crush cry cure curl curve
cycle dam damage dance dare decay deceive decide decorate delay delight deliver depend describe
desert deserve destroy detect develop disagree disappear discover dislike divide double doubt drag
drain dream dress drip drop drown drum dry dust earn educate embarrass employ empty encourage end
enjoy enter entertain escape examine excite excuse exercise exist expand expect explain explode
extend face fade fail fancy fasten fax fear fence fetch file fill film fire fit fix flap flash float
flood flow flower fold follow fool force form found frame frighten fry gather gaze glow glue grab
grate grease greet grin grip groan guarantee guard guess guide hammer hand handle hang happen harm
hate haunt head heal heap heat help hook hop hope hover hug hum hunt hurry identify ignore imagine
impress improve include increase influence inform inject injure instruct intend interest interfere
interrupt introduce invent invite irritate itch jail jam jog join joke judge juggle jump kick kill
kiss kneel knit knock knot label land last laugh launch learn level license lick lie lighten like
list listen live load lock long look love manage march mark marry match mate matter measure melt
memorize mend milk mine miss mix moan moor mourn move muddle mug multiply murder nail name need nest
nod note notice number obey object observe obtain occur offend offer open order overflow owe own
pack paddle paint park part pass paste pat pause peck pedal peel peep perform permit phone pick
pinch pine place plan plant play please plug point poke polish pop possess post pour practise pray
preach precede prefer prepare present preserve press pretend prevent prick print produce program
promise protect provide pull pump punch puncture punish push question queue race radiate rain raise
reach realize receive recognize record reduce reflect refuse regret reign reject rejoice relax
release rely remain remember remind remove repair repeat replace reply report reproduce request
rescue retire return rhyme rinse risk rob rock roll rot rub ruin rule rush sack sail satisfy save
saw scare scatter scold scorch scrape scratch scream screw scribble scrub seal search separate serve
settle shade share shave shelter shiver shock shop shrug sigh sign signal sin sip ski skip slap slip
slow smash smell smile smoke snatch sneeze sniff snore snow soak soothe sound spare spark sparkle
spell spill spoil spot spray sprout squash squeak squeal squeeze stain stamp stare start stay steer
step stir stitch stop store strap strengthen stretch strip stroke stuff subtract succeed suck suffer
suggest suit supply support suppose surprise surround suspect suspend switch talk tame tap taste
tease telephone tempt terrify test thank thaw tick tickle tie time tip tire touch tour tow trace
trade train transport trap travel treat tremble trick trip trot trouble trust try tug tumble turn
twist type undress unfasten unite unlock unpack untidy use vanish visit wail wait walk wander want
warm warn wash waste watch water wave weigh welcome whine whip whirl whisper whistle wink wipe wish
wobble wonder work worry wrap wreck wrestle wriggle yawn yell zip zoom
""".split()
)
